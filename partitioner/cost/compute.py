"""Compute time per device: a roofline per fused kernel.

Each op's global work (FLOPs) is computed once from the program; under a sharding the local
work is the global work divided by how finely the factors that index the op's iteration space
are split. Elementwise, shape and reduction ops fuse as XLA fuses them on the hardware
(`fusion.py`): values passed inside a fusion never reach HBM, so a fused kernel's memory traffic
is what crosses its boundary. A kernel takes max(FLOPs / (peak x efficiency), bytes / (HBM
bandwidth x efficiency)).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from partitioner import roles as R
from partitioner.cost.fusion import kernels
from partitioner.ir import Program, per_program
from partitioner.rules.elementwise import NARY, UNARY

_ELEMENTWISE = set(UNARY) | set(NARY)
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "argmax", "argmin"}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_SHAPE = {"broadcast_in_dim", "reshape", "squeeze", "transpose", "iota", "concatenate", "slice",
          "pad", "dynamic_slice", "rev"}
FUSIBLE = _ELEMENTWISE | REDUCTIONS | _SHAPE
# In front of a checkpointed block's recomputation (`tracing._Builder.barrier`): orders, moves
# nothing, launches no kernel; its results are its operands.
BARRIER = "optimization_barrier"
_MOVABLE = _ELEMENTWISE | _SHAPE


def _unit_reduction(op, program: Program) -> bool:
  """A reduction over dimensions of size 1 only (the gradient of a vector bias added as `x + b`
  ends in one, `(1, 1, d) -> (d,)`): XLA's algebraic simplifier makes it a reshape, a bitcast."""
  if op.name not in REDUCTIONS or not op.inputs:
    return False
  shape = program.values[op.inputs[0]].shape
  axes = op.params.get("axes", ())
  return bool(axes) and all(shape[a] == 1 for a in axes)


class OpWork(NamedTuple):
  flops: float            # global
  kind: str               # "matmul", "conv", "vector" or "memory" (moves data only)
  dtype: str
  work_tensor: int        # tensor whose factors index the work (-1: all factors of the op)


def _work(op, program) -> OpWork:
  vals = program.values
  out = vals[op.outputs[0]] if op.outputs else None
  dtype = vals[op.inputs[0]].dtype.name if op.inputs else (out.dtype.name if out else "float32")
  name = op.name
  if name == "dot_general":
    (lc, _), _ = op.params["dimension_numbers"]
    contract = math.prod(vals[op.inputs[0]].shape[d] for d in lc)
    return OpWork(2.0 * out.size * contract, "matmul", dtype, -1)
  if name == "conv_general_dilated":
    rhs = vals[op.inputs[1]]
    rhs_spec = op.params["dimension_numbers"][1]
    per_output = rhs.shape[rhs_spec[1]] * math.prod(rhs.shape[d] for d in rhs_spec[2:])
    return OpWork(2.0 * out.size * per_output, "conv", dtype, -1)
  if name in _ELEMENTWISE:
    return OpWork(float(out.size), "vector", dtype, -1)
  if name in REDUCTIONS or name in _SCANS:
    return OpWork(float(vals[op.inputs[0]].size), "vector", dtype, 0)
  if name == "sort":
    n = vals[op.inputs[0]].shape[op.params["dimension"]]
    return OpWork(float(vals[op.inputs[0]].size) * max(1.0, math.log2(max(n, 2))), "vector",
                  dtype, 0)
  if name == "gather":
    return OpWork(0.0, "memory", dtype, len(op.inputs))  # the output indexes the work
  if name == "scatter-add":
    return OpWork(float(vals[op.inputs[2]].size), "vector", dtype, 2)
  return OpWork(0.0, "memory", dtype, -1)


@per_program
def op_work(program: Program) -> list[OpWork]:
  """Each op's global work, which neither the sharding nor the hardware changes."""
  return [_work(op, program) for op in program.ops]


class ProgramWork:
  """What the cost of a program on a hardware's fusion depends on that no sharding changes;
  computed once."""

  def __init__(self, program: Program, fusion: str):
    self.program = program
    ops = program.ops
    self.work = op_work(program)
    self.producer = np.array([-1 if v.producer is None else v.producer for v in program.values],
                             np.int64)
    self.order = _run_order(program)
    # A slice reads only what it writes (one layer of a stacked weight, not the stack).
    scale = np.array([_read_scale(op, program) for op in ops], np.float64)
    k = kernels(program, self.order, [op.name in FUSIBLE for op in ops],
                [op.name in REDUCTIONS and not _unit_reduction(op, program) for op in ops],
                scale, fusion)
    self.internal = k.internal
    self.group = k.group          # the fused kernel of each op, numbered in run order
    self.groups = k.groups
    self.last_run = k.last_run    # where an op's operands are last read
    # Arrays for the costs of ops that read and write their values as they are laid out; an op
    # recomputed in several kernels reads its operands in each.
    self.global_flops = np.array([w.flops for w in self.work])
    self.work_tensor = [w.work_tensor for w in self.work]
    self.value_bytes = np.array([v.nbytes for v in program.values], np.float64)
    self.is_const = np.array([v.is_const for v in program.values], bool)
    self.work_value = np.array([_work_value(op, w) for op, w in zip(ops, self.work)], np.int64)
    self.read_scale = k.read_scale
    edges = [(op.index, v) for op in ops for v in op.inputs if not self.internal[v]]
    self.read_op, self.read_value = (np.array(e, np.int64).reshape(-1) for e in zip(*edges)) \
        if edges else (np.zeros(0, np.int64),) * 2
    edges = [(op.index, v) for op in ops for v in op.outputs
             if not self.internal[v] and scale[op.index]]
    self.write_op, self.write_value = (np.array(e, np.int64).reshape(-1) for e in zip(*edges)) \
        if edges else (np.zeros(0, np.int64),) * 2
    self.write_scale = np.array([_write_scale(op, program) for op in ops], np.float64)

  @staticmethod
  @per_program
  def of(program: Program, fusion: str) -> "ProgramWork":
    return ProgramWork(program, fusion)


def _run_order(program: Program) -> list[int]:
  """The order ops run in: program order, reordered as XLA's scheduler does to overlap
  gradient reductions with the backward pass. Cheap backward ops (elementwise, shape, a
  reduction over unit dimensions) run just before their first reader, so a gradient's transpose
  does not wait for its reduction inside the backward pass; and the optimizer update (ops
  downstream of optimizer state or writing only updated state, that nothing else reads) runs
  last, in the order its gradients are ready.
  Nothing moves into or out of a loop's body."""
  ops, values, users = program.ops, program.values, program.users
  n = len(ops)
  region = program.region_of if program.regions else np.full(n, -1)
  roles = R.roles(program)
  forward = R.loss_ops(program)
  state_out = {o for i, o in enumerate(program.outputs) if i in program.aliases}
  downstream = R.depends_on(program, tuple(roles.opt_state))
  tail = [op.index not in forward and region[op.index] < 0 and (
      any(v in downstream for v in op.outputs) or
      (bool(op.outputs) and all(v in state_out for v in op.outputs))) for op in ops]
  for op in reversed(ops):   # nothing outside the tail may read it
    if tail[op.index] and any(not tail[u] for v in op.outputs for u in users[v]):
      tail[op.index] = False
  key = [float(i) for i in range(n)]
  for op in ops:             # the update, in the order the ops it waits for finish
    if tail[op.index]:
      r = 0.0
      for v in op.inputs:
        p = values[v].producer
        if p is not None:
          r = max(r, key[p] if tail[p] else p + n)
      key[op.index] = r
  for op in reversed(ops):
    if not tail[op.index] and op.index not in forward and (op.name in _MOVABLE or
                                                           _unit_reduction(op, program)):
      readers = [key[u] for v in op.outputs for u in users[v]]
      if readers and all(region[u] == region[op.index] for v in op.outputs for u in users[v]):
        key[op.index] = min(readers) - 0.5
  return sorted(range(n), key=lambda i: (key[i], i))


def _read_scale(op, program) -> float:
  """The share of its operands' bytes an op reads: a slice reads its result's worth; a
  squeeze, a reduction over unit dimensions, or a broadcast that only adds unit dimensions, is
  a bitcast in XLA and moves nothing (0: neither read nor written); so do a loop's entry and
  exit: XLA's while loop passes its buffers by reference, the body reads a stacked input's
  slice where it uses it (priced there, every iteration) and writes each iteration's result in
  place; nor does an optimization barrier, which only orders."""
  if op.name in ("scan_enter", "scan_exit", BARRIER):
    return 0.0
  if op.name == "squeeze" or _unit_reduction(op, program) or (
      op.name == "broadcast_in_dim" and op.inputs and
      program.values[op.inputs[0]].size == program.values[op.outputs[0]].size):
    return 0.0
  if op.name in ("slice", "dynamic_slice", "gather") and op.inputs and op.outputs:
    size = program.values[op.inputs[0]].size   # a gather reads the rows it gathers
    return min(1.0, program.values[op.outputs[0]].size / size) if size else 1.0
  if op.name == "dynamic_update_slice":   # in place: reads the update, not the buffer
    size = sum(program.values[v].size for v in op.inputs[:2])
    return program.values[op.inputs[1]].size / size if size else 1.0
  if op.name == "scatter-add":   # in place: reads the updates and the rows they add to
    size = sum(program.values[v].size for v in op.inputs)
    rows = 2 * program.values[op.inputs[2]].size + program.values[op.inputs[1]].size
    return min(1.0, rows / size) if size else 1.0
  return 1.0


def _write_scale(op, program) -> float:
  """The share of its results' bytes an op writes: an update in place writes the update."""
  if op.name in ("dynamic_update_slice", "scatter-add"):
    size = program.values[op.outputs[0]].size
    update = op.inputs[1 if op.name == "dynamic_update_slice" else 2]
    return min(1.0, program.values[update].size / size) if size else 1.0
  return 1.0


def _work_value(op, w: OpWork) -> int:
  """The value whose local size divides the op's work when nothing is resharded (-1: none)."""
  if not w.flops:
    return -1
  tensors = list(op.inputs) + list(op.outputs)
  if w.work_tensor < 0:
    return op.outputs[0] if op.outputs else -1
  return tensors[w.work_tensor]


def op_cost(op, op_plan, w: OpWork, table, work: ProgramWork, dims, count) -> tuple[float, float]:
  """Local FLOPs and HBM bytes of one op, from its factors and plan: the reference that the
  simulator's array computation is tested against."""
  flops = 0.0
  if w.flops:
    shard = 1
    if w.work_tensor < 0:
      for ax in op_plan.fac_axes:
        if ax:
          shard *= count(ax)
    else:
      fac = table[op.index].factors
      for fl in (fac.operands + fac.results)[w.work_tensor]:
        for f in fl:
          if op_plan.fac_axes[f]:
            shard *= count(op_plan.fac_axes[f])
    flops = w.flops / shard
  nbytes = 0.0
  internal, value_bytes = work.internal, work.value_bytes
  for vid, want in zip(op.inputs, op_plan.operand_dims):
    if not internal[vid]:
      nbytes += value_bytes[vid] / _divisor(want, count) * work.read_scale[op.index]
  for vid in op.outputs:
    if not internal[vid] and work.read_scale[op.index]:
      nbytes += value_bytes[vid] / _divisor(dims[vid], count) * work.write_scale[op.index]
  return flops, nbytes


def _divisor(dims, count) -> int:
  n = 1
  for d in dims:
    if d:
      n *= count(d)
  return n


class Divisors:
  """How many pieces each value is cut into on a mesh (constants are read whole)."""

  def __init__(self, program: Program, sizes):
    self.sizes = sizes
    self._by_axes: dict = {}
    self._by_dims: dict = {}
    self.is_const = np.array([v.is_const for v in program.values], bool)

  def count(self, axes) -> int:
    n = self._by_axes.get(axes)
    if n is None:
      n = self._by_axes[axes] = math.prod(self.sizes[a] for a in axes)
    return n

  def of(self, dims) -> int:
    n = self._by_dims.get(dims)
    if n is None:
      n = self._by_dims[dims] = _divisor(dims, self.count)
    return n

  def values(self, dims: list, base: np.ndarray | None = None, changed=()) -> np.ndarray:
    """Per value; from `base` (the divisors before) updating only the `changed` values."""
    if base is None:
      out = np.array(self._lookup(dims), np.float64)
      out[self.is_const] = 1
      return out
    out = base.copy()
    if changed:
      changed = np.fromiter(changed, np.int64, len(changed))
      out[changed] = self._lookup([dims[v] for v in changed.tolist()])
      out[changed[self.is_const[changed]]] = 1
    return out

  def _lookup(self, dims: list) -> list[int]:
    """Divisors of layouts, the known ones looked up in bulk."""
    out = list(map(self._by_dims.get, dims))
    if None in out:
      out = [n or self.of(d) for n, d in zip(out, dims)]
    return out


_EFF = {"matmul": "matmul", "conv": "conv", "vector": "vector", "memory": "vector"}

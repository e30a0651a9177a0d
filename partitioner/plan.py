"""The SPMD plan: for every op, what each device reads, computes and communicates.

Derived from the final shardings alone: each op agrees its factor axes from its tensors (the
same merge propagation uses), reads its operands in the layout those axes imply (resharding
where a value is laid out otherwise), produces a local result that is partial over the axes of
its sharded reduction factors, and reshards that into the value's own sharding, unless the sum
is deferred to a later linear op (partial_sums.py). Both lowerings and the cost model read this
plan, so the collectives they see are the same.

A resharded copy of a value is made once and shared by the ops that read that layout, but not
kept from the forward pass into the backward pass: as FSDP does, a gathered parameter is
gathered again for the backward, and activations are kept in their own (smaller) sharding.
A loop's body reshards what it makes in every iteration; what it reads from outside (a
parameter, a loop-invariant activation) is resharded once before the loop and kept to its end.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from partitioner.collectives import (COLLECTIVE_PERMUTE, SLICE, Collective, Step, reshard_steps,
                                     result_writes)
from partitioner.factors import REDUCE_OF_KIND, join_dim
from partitioner.ir import SCAN_EXIT, per_program
from partitioner.partial_sums import NOTHING_HELD, Held, defer
from partitioner.propagation import ShardingState, priority_order
from partitioner.roles import loss_ops
from partitioner.sharding import Dims, Sharding


class OpPlan(NamedTuple):
  fac_axes: tuple
  operand_dims: tuple[Dims, ...]          # the layout the local op reads
  result: tuple[Sharding, ...]            # what the local op produces (maybe partial)
  operand_steps: tuple[tuple[Step, ...], ...]
  result_steps: tuple[tuple[Step, ...], ...]
  pieces: tuple[int, ...]                 # per operand then result: into how many local pieces
  split: int                              # into how many pieces the iteration space is cut
  reads: tuple[int, ...]                  # the operands read through a resharded copy
  writes: tuple[tuple[int, bool], ...]    # per result resharded: (position, out of place?)

  @property
  def communicates(self) -> bool:
    return bool(self.reads or self.writes)


class Copy(NamedTuple):
  """A resharded copy of a value: made before op `first`, last read by op `last` (for a copy a
  loop reads, its enter and exit ops)."""
  value: int
  dims: Dims
  first: int
  last: int


class Staged(NamedTuple):
  """A local result resharded out of place (not by an all-reduce alone): it has a buffer of its
  own while op `op` runs."""
  op: int
  value: int
  dims: Dims


class Plan(NamedTuple):
  ops: list[OpPlan]
  collectives: list[Collective]
  copies: list[Copy]
  copy_of: dict[tuple[int, int], int]     # (op, operand position) -> the copy it reads
  communicating: list[int]                # ops with operand or result steps or a partial
                                          # result, in order
  staged: list[Staged]
  held: Held                              # partial sums deferred (partial_sums.py)
  planned: tuple[list, list]              # ops and communicating before deferral


def _dims(dfs, fac_axes, fsizes, mesh) -> Dims:
  return tuple(() if not fl else fac_axes[fl[0]] if len(fl) == 1 else
               join_dim(fl, fac_axes, fsizes, mesh) for fl in dfs)


@per_program
def shift_ops(program) -> tuple[int, ...]:
  """The ops that communicate by themselves: `stage_shift`s (a pipeline's hand-over)."""
  return tuple(op.index for op in program.ops if op.name == "stage_shift")


def _record(collectives, steps, vid, op, copy=-1):
  for s in steps:
    if s.kind != SLICE:
      collectives.append(Collective(s.kind, s.axes, s.bytes, vid, op, s.reduce, copy))


def _op_plan(state: ShardingState, op, memo: dict) -> OpPlan:
  """The op's plan, shared by every op of its class whose tensors are laid out alike."""
  table = state.table
  entry = table.entries[op.index] or table[op.index]
  pick = entry.pick
  key = ("plan", entry.klass, pick(state.layout_ids), pick(state.prio))
  plan = memo.get(key)
  if plan is None:
    general = key[:3] + (priority_order(key[3]),)
    plan = memo.get(general)
    if plan is None:
      plan = memo[general] = _plan_op(state, op)
    memo[key] = plan
  return plan


def _representable(fac_axes: tuple, fac, tensors, mesh) -> tuple:
  """The factor axes without those some tensor cannot lay out: in a dimension made of several
  factors (a reshape's merged dimension), a factor after one that is not split whole cannot be
  split (its pieces would not be contiguous), so the op runs with it whole and the tensor that
  has it split is resharded."""
  out = None
  for _, dfs in tensors:
    for fl in dfs:
      if len(fl) < 2:
        continue
      whole = True
      for f in fl:
        if not whole:
          if fac_axes[f]:
            out = out or list(fac_axes)
            out[f] = ()
        elif math.prod(mesh[a] for a in fac_axes[f]) != fac.sizes[f]:
          whole = False
  return fac_axes if out is None else tuple(out)


def _plan_op(state: ShardingState, op) -> OpPlan:
  values, mesh = state.program.values, state.sizes
  fac, tensors, n_in = state.table[op.index][:3]
  fac_axes = _representable(tuple(state.merge(op.index)), fac, tensors, mesh)
  operand_dims = tuple(_dims(dfs, fac_axes, fac.sizes, mesh) for _, dfs in tensors[:n_in])
  partial, reduce = (), "sum"
  for f, kind in enumerate(fac.kinds):
    if kind in REDUCE_OF_KIND and fac_axes[f]:
      partial += fac_axes[f]
      reduce = REDUCE_OF_KIND[kind]
  results = tuple(Sharding(_dims(dfs, fac_axes, fac.sizes, mesh), partial, reduce)
                  for _, dfs in tensors[n_in:])
  if op.primitive is SCAN_EXIT:
    # A carry keeps the layout of the iteration's carry (the enter op's result) all around the
    # loop, as a data-flow edge does in Shardy: the body's carry is resharded to it before
    # the next iteration, and the final carry is made in it.
    n = op.params["num_carry"]
    carry = tuple(state.dims[v] for v in op.inputs[n_in - n:])
    operand_dims = carry + operand_dims[n:n_in - n] + carry
    results = tuple(Sharding(d) for d in carry) + results[n:]
  operand_steps = []
  for vid, want in zip(op.inputs, operand_dims):
    v = values[vid]
    have = ((),) * v.rank if v.is_const else state.dims[vid]
    operand_steps.append(reshard_steps(v.shape, v.dtype.itemsize, have, (), "sum", want, mesh))
  result_steps = tuple(
      reshard_steps(values[vid].shape, values[vid].dtype.itemsize, local.dims, local.partial,
                    local.reduce, state.dims[vid], mesh)
      for vid, local in zip(op.outputs, results))
  count = lambda axes: math.prod(mesh[a] for a in axes)
  pieces = tuple(math.prod(count(d) for d in dims)
                 for dims in operand_dims + tuple(r.dims for r in results))
  split = pieces[n_in] * count(results[0].partial) if results else 1
  reads = tuple(k for k, steps in enumerate(operand_steps) if steps)
  return OpPlan(fac_axes, operand_dims, results, tuple(operand_steps), result_steps, pieces,
                split, reads, result_writes(result_steps))


def make_plan(state: ShardingState, base: Plan | None = None, deferral: bool = True) -> Plan:
  """The plan for `state`; with `base`, the plan of the state it was copied from, only the ops
  that read or write a changed value are planned again. Without `deferral`, every partial sum
  is reduced by its producer (to measure what deferring saves)."""
  program, program_ops = state.program, state.program.ops
  memo = state.table.memo(state.mesh)
  if base is None:
    ops = [_op_plan(state, op, memo) for op in program.ops]
    communicating = [i for i, p in enumerate(ops) if p.communicates]
  else:
    ops, communicating = base.planned
    ops = list(ops)
    touching = state.table.touching
    todo = set()
    for v in state.changed:
      todo.update(touching[v])
    for i in todo:
      ops[i] = _op_plan(state, program_ops[i], memo)
    communicating = sorted({i for i in communicating if i not in todo} |
                           {i for i in todo if ops[i].communicates})
  planned = (ops, communicating)
  held = NOTHING_HELD
  if deferral:
    ops, communicating, held = defer(state, ops, communicating)
  # Copies and collectives, in program order.
  collectives: list[Collective] = []
  copies: list[Copy] = []
  copy_of: dict = {}
  staged: list[Staged] = []
  made: dict = {}           # (value, layout, in forward pass, loop it is made in) -> copy
  forward = loss_ops(program)
  region_of = program.region_of if program.regions else None
  values = program.values
  writes_of = memo.get("writes")   # per op: (its plan, the collectives and staged results)
  if writes_of is None:
    writes_of = memo["writes"] = [None] * len(program_ops)
  shifts = shift_ops(program)
  for i in (sorted(set(communicating).union(shifts)) if shifts else communicating):
    op, op_plan = program_ops[i], ops[i]
    if shifts and op.name == "stage_shift":
      from partitioner.rules.shift import crossing
      axes, nbytes = crossing(op, values[op.inputs[0]], op_plan.operand_dims[0], state.sizes)
      if axes:
        collectives.append(Collective(COLLECTIVE_PERMUTE, axes, nbytes, op.outputs[0], i))
    for k in op_plan.reads:
      vid, want = op.inputs[k], op_plan.operand_dims[k]
      at = last = i
      if region_of is not None:   # a loop reads what it did not make: resharded before it
        at, last = program.hoist(i, values[vid].producer)
      key = (vid, want, i in forward, -1 if region_of is None else int(region_of[at]))
      c = made.get(key)
      if c is None:
        c = made[key] = len(copies)
        copies.append(Copy(vid, want, at, last))
        _record(collectives, op_plan.operand_steps[k], vid, at, c)
      else:
        copies[c] = copies[c]._replace(last=max(copies[c].last, last))
      copy_of[(i, k)] = c
    if op_plan.writes:   # the same for every state where op i has this plan
      written = writes_of[i]
      if written is None or written[0] is not op_plan:
        made_here: list[Collective] = []
        for k, _ in op_plan.writes:
          _record(made_here, op_plan.result_steps[k], op.outputs[k], i)
        written = writes_of[i] = (op_plan, made_here, [
            Staged(i, op.outputs[k], op_plan.result[k].dims) for k, out in op_plan.writes if out])
      collectives += written[1]
      staged += written[2]
  return Plan(ops, collectives, copies, copy_of, communicating, staged, held, planned)

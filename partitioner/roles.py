"""What the values of a program are for, found from the dataflow.

Tactics must find their targets in any model, whatever its arguments are called. State is the
inputs whose updated version is an output; parameters are the state the loss (the outputs
that are not state) is computed from; optimizer state is the rest of the state that the new
parameters are computed from (moments, counts); what remains of the state is model state
(batch-norm statistics). Inputs that are not state are data, unless their name says they are
parameters or optimizer state (a function with no updated state, or frozen weights), and
names decide for every input of a step that returns no loss. The
forward pass is what the loss depends on; Megatron pairs are found by following a weight's
output factor through the forward pass until another weight contracts it.
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from partitioner.factors import MAX, PASS, REPL, SUM, split_dim
from partitioner.ir import Program, per_program
from partitioner.propagation import factor_table
from partitioner.rules.elementwise import NARY, UNARY

_ELEMENTWISE = frozenset(UNARY) | frozenset(NARY)

# Names only decide for inputs that are not state.
_PARAM = re.compile(r"param|weight|variables|state", re.I)
_OPT = re.compile(r"opt", re.I)


class Roles(NamedTuple):
  params: tuple[int, ...]
  opt_state: tuple[int, ...]
  data: tuple[int, ...]
  model_state: tuple[int, ...] = ()

  @property
  def weights(self) -> tuple[int, ...]:
    """Parameters and model state: what memory and observations count as the model."""
    return self.params + self.model_state


def _top(name: str) -> str:
  return name.split("/", 1)[0]


def _is_key(v) -> bool:
  """Raw PRNG key data, or a typed key; bfloat16 (NumPy kind "V" too) is not one."""
  return (v.dtype == np.uint32 and v.rank >= 1 and v.shape[-1] == 2 or
          v.dtype.kind == "V" and not jnp.issubdtype(v.dtype, jnp.floating))


def ancestors(program: Program, targets, by_carry: bool = False) -> set[int]:
  """Values the `targets` are computed from (themselves included). With `by_carry`, loops are
  seen through carry by carry: a loop's final carry is computed from what its body makes of
  that carry, a body's carry from its initial value and from what the body makes of it, a
  stacked output from its per-iteration value; not from every value the loop carries. Where
  one loop runs the forward and backward passes of several micro-batches (a 1F1B pipeline),
  the loss then depends on the forward work alone."""
  seen, stack = set(targets), list(targets)
  ops, values = program.ops, program.values
  while stack:
    v = stack.pop()
    p = values[v].producer
    if p is None:
      continue
    op = ops[p]
    reads = op.inputs
    if by_carry and op.name in ("scan_enter", "scan_exit"):
      k = op.outputs.index(v)
      reads = [op.inputs[k]]
      if op.name == "scan_enter" and k < op.params["num_carry"]:
        reads.append(ops[program.regions[program.region_starts[p]].exit].inputs[k])
    for u in reads:
      if u not in seen:
        seen.add(u)
        stack.append(u)
  return seen


@per_program
def loss_outputs(program: Program) -> tuple[int, ...]:
  """The outputs that are not state (loss, metrics), less those computed from constants only:
  a Flax `TrainState` whose step count is a Python int returns `step + 1`, which no input
  reaches, and a step that returns only its state is no less without a loss for it."""
  inputs = set(program.inputs)
  return tuple(v for i, v in enumerate(program.outputs)
               if i not in program.aliases and inputs & ancestors(program, [v]))


@per_program
def roles(program: Program) -> Roles:
  state = program.aliased
  loss = list(loss_outputs(program))
  read_by_loss = ancestors(program, loss)
  new_params = [o for v in state if v in read_by_loss for o in state[v]]
  read_by_update = ancestors(program, new_params)
  params, opt, data, model = [], [], [], []
  for vid, name in zip(program.inputs, program.input_names):
    if vid in state and loss:   # without a loss among the outputs, names decide
      if vid in read_by_loss:
        params.append(vid)
      elif vid in read_by_update:
        opt.append(vid)
      else:
        model.append(vid)
      continue
    top = _top(name)
    if _OPT.search(top):
      opt.append(vid)
    elif _PARAM.search(top):
      params.append(vid)
    elif program.values[vid].rank >= 1 and not _is_key(program.values[vid]):
      data.append(vid)
  return Roles(tuple(params), tuple(opt), tuple(data), tuple(model))


def batch_dim(program: Program, vid: int) -> int:
  """The dimension that carries the batch in a data input: the leading one, or the next when
  the leading one is a loop's (micro-batches stacked for a `lax.scan`)."""
  return 1 if stacked_dims(program).get(vid) == 0 and program.values[vid].rank > 1 else 0


def batch_inputs(program: Program, candidates) -> tuple[list[int], list[int]]:
  """The data inputs that carry the batch: the most common size of their batch dimension
  (`batch_dim`; ties: the largest)."""
  size_of = {v: program.values[v].shape[batch_dim(program, v)] for v in candidates}
  sizes = collections.Counter(size_of.values())
  if not sizes:
    return [], []
  size = max(sizes, key=lambda s: (sizes[s], s))
  picked = [v for v in candidates if size_of[v] == size]
  return picked, [v for v in candidates if v not in picked]


def aliased_outputs(program: Program, vid: int) -> tuple[int, ...]:
  """The outputs that are the updated version of input `vid` (new params for params)."""
  return program.aliased.get(vid, ())


@per_program
def _params_by_suffix(program: Program) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Every path suffix of every parameter's name -> the parameters ending with it."""
  out: dict[tuple[str, ...], list[int]] = {}
  for p in roles(program).params:
    parts = tuple(program.name(p).split("/"))
    for k in range(len(parts)):
      out.setdefault(parts[k:], []).append(p)
  return {k: tuple(v) for k, v in out.items()}


def matching_param(program: Program, opt_vid: int) -> int | None:
  """The parameter an optimizer-state leaf belongs to: among parameters of its shape, the one
  whose path shares the longest suffix with its path (`opt_state/0/mu/dense/w` and
  `params/dense/w`, `state/opt_state/0/nu/Dense_0/kernel` and `state/params/Dense_0/kernel`)."""
  by_suffix = _params_by_suffix(program)
  parts = tuple(program.name(opt_vid).split("/"))
  shape = program.values[opt_vid].shape
  for k in range(1, len(parts)):
    found = [p for p in by_suffix.get(parts[k:], ()) if program.values[p].shape == shape]
    if len(found) == 1:
      return found[0]
    if found:
      return None  # ambiguous: a shorter suffix only matches more
  return None


@per_program
def forward_ops(program: Program) -> frozenset[int]:
  """Ops of the forward pass: those the non-state outputs (loss, metrics) depend on, through
  loops carry by carry (`ancestors(..., by_carry=True)`). A step that returns only its new
  state has no loss to follow: there, everything but what the gradient's seed starts
  (`backward_ops`); every op where no seed is found."""
  return _loss_ops(program, by_carry=True)


@per_program
def loss_ops(program: Program) -> frozenset[int]:
  """`forward_ops` with each loop counted whole: a loop the loss depends on is all forward,
  also a 1F1B pipeline's, which runs the backward work in the same loop. The simulator's run
  order and its sharing of copies between uses were built on this (cost model 15); on
  pipelined plans with ZeRO, moving them to `forward_ops` moves predicted steps and peaks by
  up to 5% either way (gpt:350m,scan=true on pipe=4,data=16), a change of the cost model to be
  measured before it is made."""
  return _loss_ops(program, by_carry=False)


def _loss_ops(program: Program, by_carry: bool) -> frozenset[int]:
  everything = frozenset(range(len(program.ops)))
  if not program.aliases:
    return everything
  targets = loss_outputs(program)
  if not targets:
    backward = backward_ops(program)
    return everything - backward if backward else everything
  return frozenset(p for v in ancestors(program, targets, by_carry)
                   if (p := program.values[v].producer) is not None)


def backward_ops(program: Program) -> frozenset[int]:
  """The ops `jax.grad`'s seed starts: the backward pass and the update after it.

  `jax.grad` transposes the loss from the constant 1.0, so the backward pass begins at an op of
  constant operands, one of them the scalar 1.0 (`1.0 / n` for a mean, a broadcast of 1.0 for
  a sum), and everything it starts depends on residuals of the forward pass, never the other
  way. Other such ops start a part of the forward pass (`jnp.ones` masks: the loss depends on
  them), or a part of the backward pass (per-token broadcasts of 1.0 that only derivatives
  read, made in the forward pass of HF's models with LayerNorm: GPT-2, BERT, OPT, BLOOM...).
  Where the step returns its loss, the seed is the op reading 1.0 (its other operands may be
  data where it makes a scalar: `1.0 / count` for a mean over the tokens a mask keeps) that
  the loss does not depend on, starts a matmul and starts the most ops; elsewhere, the op of
  constant operands reading 1.0 that starts a matmul and the fewest ops. Empty where there is
  none (a step without `jax.grad`)."""
  inputs = set(program.inputs)
  constant = lambda v: program.values[v].producer is None and v not in inputs
  loss = ancestors(program, loss_outputs(program)) if program.aliases else set()

  def one(v) -> bool:
    value = program.values[v]
    try:
      # float kinds, and "V" for bfloat16 (ml_dtypes); a key's data fails float()
      return value.rank == 0 and value.dtype.kind in "fV" and float(value.const) == 1.0
    except (TypeError, ValueError):
      return False

  def may_seed(op) -> bool:
    if not op.inputs or not any(one(v) for v in op.inputs):
      return False
    if not loss:
      return all(constant(v) for v in op.inputs)
    return not any(v in loss for v in op.outputs) and (
        all(constant(v) for v in op.inputs)
        or not any(program.values[v].rank for v in op.outputs))

  best: frozenset[int] = frozenset()
  for op in filter(may_seed, program.ops):
    started = frozenset(p for v in depends_on(program, tuple(op.outputs))
                        if (p := program.values[v].producer) is not None)
    if any(program.ops[p].name == "dot_general" for p in started) and (
        not best or (len(started) > len(best) if loss else len(started) < len(best))):
      best = started
  return best


@per_program
def depends_on(program: Program, sources: tuple[int, ...]) -> frozenset[int]:
  """Values computed (transitively) from `sources`. A loop carry that the body makes from
  them is computed from them all around the loop (its next iteration reads it)."""
  reached = set(sources)
  ops = program.ops
  while True:
    for op in ops:
      if any(v in reached for v in op.inputs):
        reached.update(op.outputs)
    carried = {ops[r.enter].outputs[j] for r in program.regions for j in range(r.num_carry)
               if ops[r.exit].inputs[j] in reached} - reached
    if not carried:
      return frozenset(reached)
    reached |= carried


def param_source(program: Program, vid: int, params: frozenset[int]):
  """If `vid` is a parameter seen through casts, transposes and slices of a stacked parameter
  (one layer of `lax.scan` over stacked weights, unrolled or in a loop's body; its layers cut
  into pipeline stages): (param, dim map), else None."""
  dims = list(range(program.values[vid].rank))
  while vid not in params:
    p = program.values[vid].producer
    if p is None:
      return None
    op = program.ops[p]
    src = program.values[op.inputs[0]] if op.inputs else None
    if op.name in ("convert_element_type", "copy", "reduce_precision"):
      vid = op.inputs[0]
    elif op.name in ("slice", "dynamic_slice") and all(   # one layer of a stacked weight
        n in (1, m) for n, m in zip(program.values[vid].shape, src.shape)):
      vid = op.inputs[0]
    elif op.name == "transpose":
      perm = op.params["permutation"]
      dims = [perm[d] for d in dims]
      vid = op.inputs[0]
    elif op.name == "squeeze":
      kept = [d for d in range(src.rank) if d not in op.params["dimensions"]]
      dims = [kept[d] for d in dims]
      vid = op.inputs[0]
    elif op.name == "reshape" and _layers_regrouped(src.shape, program.values[vid].shape):
      # Layers cut into stages (and chunks of virtual stages): the leading dims regrouped,
      # the layer's own dims after them as they were.
      k = len(_common_tail(src.shape, program.values[vid].shape))
      lead = program.values[vid].rank - k
      dims = [d - lead + src.rank - k if d >= lead else 0 for d in dims]
      vid = op.inputs[0]
    elif op.name == "gather" and _is_chunk_pick(op, src, program.values[vid]):
      vid = op.inputs[0]   # each pipeline stage's chunk of its layers (virtual stages)
    elif op.name == "scan_enter" and op.outputs.index(vid) >= op.params["num_carry"]:
      vid = op.inputs[op.outputs.index(vid)]   # one iteration's slice of a stacked input
      dims = [d + 1 for d in dims]
    else:
      return None
  return vid, dims


def _common_tail(a: tuple, b: tuple) -> tuple:
  k = 0
  while k < min(len(a), len(b)) and a[len(a) - 1 - k] == b[len(b) - 1 - k]:
    k += 1
  return a[len(a) - k:]


def _layers_regrouped(src: tuple, out: tuple) -> bool:
  """Whether a reshape only regroups the leading (layer, stage, chunk) dims of a stacked
  weight: the same trailing dims, all but the first of the source's among them, and the
  leading dims holding as many elements on both sides."""
  tail = _common_tail(src, out)
  k = len(tail)
  return (0 < len(src) - k <= 3 and 0 < len(out) - k <= 3 and k >= len(src) - 3 and
          math.prod(src[:len(src) - k]) == math.prod(out[:len(out) - k]) and
          (len(src) - k == 1 or len(out) - k == 1))


def _is_chunk_pick(op, src, out) -> bool:
  """A gather of one chunk of rows per stage from `[V*c, S, ...]` (`pipeline._pick`): every
  dim but the stage's a window, the layer's own dims whole."""
  dn = op.params["dimension_numbers"]
  return (src.rank == out.rank >= 2 and tuple(dn.collapsed_slice_dims) == (1,) and
          tuple(dn.offset_dims) == (0,) + tuple(range(2, out.rank)) and
          out.shape[1] == src.shape[1] and out.shape[2:] == src.shape[2:])


@per_program
def stacked_dims(program: Program) -> dict[int, int]:
  """Inputs stacked over a loop -> their loop dimension: layers (`hk.layer_stack`, `nn.scan`,
  `lax.scan` over a dict of weights) or micro-batches. Every forward-pass read takes one slice
  along it (a scan unrolled when traced), or it is a scanned-over operand of a loop.
  Optimizer state has the layer dimension of its parameter. Tactics meant for the batch or the
  model never tile it."""
  forward = forward_ops(program)
  r = roles(program)
  found: dict[int, int] = {}
  for vid in r.weights + r.data:
    value, dims = program.values[vid], None
    for u in program.users[vid]:
      if u not in forward:
        continue
      op = program.ops[u]
      if op.name in ("slice", "dynamic_slice") and op.inputs[0] == vid:
        out = program.values[op.outputs[0]].shape
        here = {d for d in range(value.rank) if out[d] == 1 and value.shape[d] > 1}
      elif op.name == "scan_enter" and op.inputs.index(vid) >= op.params["num_carry"]:
        here = {0}
      else:
        dims = set()
        break
      dims = here if dims is None else dims & here
    if dims and len(dims) == 1:
      found[vid] = dims.pop()
  for o in r.opt_state:
    p = matching_param(program, o)
    if p in found:
      found[o] = found[p]
  return found


class MegatronPair(NamedTuple):
  column: int          # the weight split along its output (free) dimension
  column_dim: int
  rows: tuple          # ((weight, dim), ...) that contract that dimension afterwards
  # A fused projection (q, k and v from one matmul, then split): the (value, dim) of each
  # chunk, tiled instead of the weight, whose rows hold every chunk's heads in turn.
  chunks: tuple = ()


@per_program
def megatron_pairs(program: Program, axis_size: int) -> tuple[MegatronPair, ...]:
  """Column/row weight pairs: a weight's output dimension that flows, through pass-through
  ops only (no reduction over it), into the contracting dimension of other weights."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  table = factor_table(program)
  assigned: set[int] = set()
  pairs = []
  for w, dmap, fd, size, result, rdim in _weight_matmuls(program, params, forward):
    if w in assigned or size % axis_size:
      continue
    rows = _flow_to_rows(program, table, forward, params, result, rdim, axis_size, w)
    if rows:
      rows = tuple(r for r in rows if r[0] not in assigned and r[0] != w)
    if rows:
      pairs.append(MegatronPair(w, dmap[fd], rows))
      assigned.add(w)
      assigned.update(r[0] for r in rows)
      continue
    chunks = _fused_chunks(program, forward, result, rdim, axis_size)
    if chunks:
      flows = [_flow_to_rows(program, table, forward, params, c, d, axis_size, w)
               for c, d in chunks]
      if all(flows):
        rows = tuple(dict.fromkeys(r for f in flows for r in f if r[0] != w))
        pairs.append(MegatronPair(w, dmap[fd], rows, tuple(chunks)))
        assigned.update(r[0] for r in rows)
  return tuple(pairs)


def _weight_matmuls(program: Program, params, forward):
  """Per forward-pass matmul of a weight (rank 2 and up) with an activation: the weight, its
  dimension map, its first free dimension (an output feature) and that dimension's size, the
  result and the result's dimension it becomes (batch dims, then lhs free, then rhs free)."""
  for op in program.ops:
    if op.name != "dot_general" or op.index not in forward:
      continue
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    sources = [param_source(program, v, params) for v in op.inputs]
    for side in (0, 1):
      src = sources[side]
      if src is None or sources[1 - side] is not None or program.values[src[0]].rank < 2:
        continue
      contract, batch = (lc, lb) if side == 0 else (rc, rb)
      value = program.values[op.inputs[side]]
      free = [d for d in range(value.rank) if d not in contract and d not in batch]
      if not free:
        continue
      lhs_free = [d for d in range(program.values[op.inputs[0]].rank)
                  if d not in lc and d not in lb]
      rdim = len(lb) + (lhs_free.index(free[0]) if side == 0 else len(lhs_free))
      yield src[0], src[1], free[0], value.shape[free[0]], op.outputs[0], rdim


@per_program
def matmul_weights(program: Program) -> tuple[int, ...]:
  """Parameters (rank 2 and up) that a forward-pass matmul reads."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  found = {}
  for op in program.ops:
    if op.name == "dot_general" and op.index in forward:
      for v in op.inputs:
        src = param_source(program, v, params)
        if src is not None and program.values[src[0]].rank >= 2:
          found[src[0]] = None
  return tuple(found)


def _fused_chunks(program: Program, forward, start: int, dim: int, m: int):
  """If dimension `dim` of `start` is, after elementwise ops (a bias), split by slices into
  equal chunks that each divide by `m` (`jnp.split(qkv, 3, axis=-1)`): the (chunk, dim) list."""
  vid = start
  while True:
    users = [u for u in program.users[vid] if u in forward]
    value = program.values[vid]
    if users and all(program.ops[u].name == "slice" for u in users):
      break
    if len(users) != 1 or program.ops[users[0]].name not in _ELEMENTWISE:  # a bias, a cast
      return None
    out = program.ops[users[0]].outputs[0]
    if program.values[out].shape != value.shape:
      return None
    vid = out
  chunks = []
  for u in users:
    op = program.ops[u]
    starts, limits, strides = (op.params["start_indices"], op.params["limit_indices"],
                               op.params.get("strides"))
    if op.inputs[0] != vid or (strides and any(s != 1 for s in strides)):
      return None
    if any((starts[d], limits[d]) != (0, value.shape[d]) for d in range(value.rank) if d != dim):
      return None
    chunks.append((op.outputs[0], dim, starts[dim], limits[dim] - starts[dim]))
  sizes = {c[3] for c in chunks}
  if len(sizes) != 1 or len(chunks) < 2:
    return None
  size = sizes.pop()
  if size % m or sorted(c[2] for c in chunks) != list(range(0, value.shape[dim], size)):
    return None
  return [(c, d) for c, d, _, _ in chunks]


def _follow(program, table, forward, start, start_dim, m, meet) -> bool:
  """Follows one dimension (split `m` ways) forward through pass-through ops, calling
  `meet(op, operand, tensors, factor, kind)` at each op that does not pass it through (a
  reduction, a contraction); False where `meet` does, or the dimension is replicated, merged
  with another, or reaches an output."""
  mesh, users, outputs = {"_": m}, program.users, set(program.outputs)
  work, seen = [(start, start_dim)], {(start, start_dim)}
  while work:
    vid, d = work.pop()
    if vid in outputs:
      return False
    for u in users[vid]:
      if u not in forward:
        continue
      fac, tensors, n_in = table[u][:3]
      for k in range(n_in):
        if tensors[k][0] != vid:
          continue
        flist = tensors[k][1][d]
        pairs = split_dim(("_",), flist, fac.sizes, mesh) if flist else []
        if not pairs:
          return False
        f = pairs[0][0]
        kind = fac.kinds[f]
        if kind == REPL:
          return False
        if kind != PASS:
          if not meet(u, k, tensors, f, kind):
            return False
          continue
        for rv, rdfs in tensors[n_in:]:
          for rd, rfl in enumerate(rdfs):
            if f in rfl:
              if rfl[0] != f:
                return False
              if (rv, rd) not in seen:
                seen.add((rv, rd))
                work.append((rv, rd))
  return True


def _flow_to_rows(program, table, forward, params, start, start_dim, m, column):
  """Follows one sharded dimension forward; returns the weights that contract it, or None if
  it is reduced, needs replication, or reaches an output first."""
  rows = []

  def meet(u, k, tensors, f, kind):
    if kind != SUM or program.ops[u].name != "dot_general":
      return False
    other = tensors[1 - k]
    src = param_source(program, other[0], params)
    if src is None or src[0] == column:
      return False
    od = next(i for i, fl in enumerate(other[1]) if f in fl)
    rows.append((src[0], src[1][od]))
    return True

  return rows if _follow(program, table, forward, start, start_dim, m, meet) else None


@per_program
def output_heads(program: Program, axis_size: int) -> tuple[tuple[int, int], ...]:
  """(weight, output dim) of the untied output heads: weights whose output dimension (a
  vocabulary, the classes) the loss normalises by a softmax (a maximum over it, then sums)
  and no other weight contracts, dividing by `axis_size`. Megatron-LM splits such a layer by
  columns and computes the cross-entropy on its split logits. A tied head is an embedding
  table (`embedding_tables`: `EmbeddingSharding` splits it), so it is not listed."""
  params = frozenset(roles(program).params)
  tables = {v for v, _ in embedding_tables(program)}
  forward = forward_ops(program)
  table = factor_table(program)
  found = {}
  for w, dmap, fd, size, result, rdim in _weight_matmuls(program, params, forward):
    if w not in tables and program.values[w].rank == 2 and not size % axis_size and \
        _softmax_only(program, table, forward, params, result, rdim, axis_size):
      found.setdefault(w, dmap[fd])
  return tuple(found.items())


def _softmax_only(program, table, forward, params, start, start_dim, m) -> bool:
  """Whether dimension `start_dim` of `start`, followed through the forward pass, is only
  passed through and reduced, at least once by a maximum (a softmax's), never contracted with
  a weight, replicated or returned."""
  maximum = []

  def meet(u, k, tensors, f, kind):
    if kind == SUM and program.ops[u].name == "dot_general" and \
        param_source(program, tensors[1 - k][0], params) is not None:
      return False
    maximum.append(kind == MAX)
    return True

  return _follow(program, table, forward, start, start_dim, m, meet) and any(maximum)


@per_program
def expert_weights(program: Program) -> tuple[tuple[int, int], ...]:
  """(parameter, expert dim) of weights that a forward-pass dot_general treats as a batch
  dimension: one weight slice per expert, as in `einsum("becd,edh->bech", x, w)`."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  found = []
  for op in program.ops:
    if op.name != "dot_general" or op.index not in forward:
      continue
    _, batch = op.params["dimension_numbers"]
    for side in (0, 1):
      src = param_source(program, op.inputs[side], params)
      if src is None:
        continue
      for d in batch[side]:
        entry = (src[0], src[1][d])
        if entry not in found:
          found.append(entry)
  return tuple(found)


@per_program
def embedding_tables(program: Program) -> tuple[tuple[int, int], ...]:
  """(parameter, looked-up dim) of the forward pass's point-wise gathers from parameters."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  table = factor_table(program)
  found = []
  for op in program.ops:
    if op.name != "gather" or op.index not in forward:
      continue
    src = param_source(program, op.inputs[0], params)
    if src is None:
      continue
    fac = table[op.index].factors
    for d, fl in enumerate(fac.operands[0]):
      if fl and fac.kinds[fl[0]] == SUM:
        entry = (src[0], src[1][d])
        if entry not in found:
          found.append(entry)
  return tuple(found)

"""Deferred partial sums: a sum left partial by its producer is carried through linear ops and
reduced once, where the partial sums meet, as Shardy keeps a value unreduced until it must be.

A value whose producer would reduce it with one all-reduce over axes P is *held* partial
instead when its only reader is linear in it and keeps it so: an add of values held partial
over the same axes (the input gradient of separate Q, K and V projections, the gradient of a
weight read twice such as a tied embedding), or a reshape, transpose, squeeze, copy,
negation, same-width float conversion or local reduce_sum of it, or a select of it and zeros
(a pipeline's sums, kept for the stage that made them). The reader's result is
then partial over P in its turn, and the all-reduce moves there. A tree of such ops is kept
only where it saves: it joins two or more partial sums, or its root is smaller than the sum
it started from. Everywhere else each sum is reduced by its producer, as before.

A loop whose carry starts at zeros and adds a partial sum in every iteration (the gradient
of a weight a recurrence reads at every time step) keeps the carry partial: one all-reduce
after the loop replaces one per iteration. So does an inner loop's stacked output of
per-iteration partial sums that such a carry of an enclosing loop adds up (a scanned layer
stack's gradients, summed over micro-batches: `microbatch.py`), and a float cast up on the
way into either (bf16 gradients of float32 master weights are summed in float32).

The plan carries the result (`Plan.held`); the shard_map lowering holds the local pieces as
they are, the jit lowering holds them as a leading dimension split over P, and the cost
model sees one all-reduce at the root.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from partitioner.collectives import ALL_REDUCE, reshard_steps, result_writes
from partitioner.ir import SCAN_EXIT, per_program
from partitioner.sharding import Axes, Sharding, local_shape

# Linear in every operand: each must be held partial over the same axes.
JOINING = frozenset({"add", "add_any", "sub"})
# One operand, linear in it, never larger than it.
PASSING = frozenset({"neg", "reshape", "transpose", "squeeze", "expand_dims", "copy",
                     "convert_element_type", "reduce_sum"})


class Held(NamedTuple):
  """What deferral decided: values kept partial (value -> the axes it is partial over), the
  ops that make them partial and leave their reduction to a later op, the ops that read them
  (op -> the axes their result is partial over), the loop carries held (exit op -> {carry
  position: axes}; the final carry is reduced after the loop) and the zeros that start them
  (value -> axes: zeros are a partial sum of zeros)."""
  values: dict
  leaves: frozenset
  ops: dict
  carries: dict
  zeros: dict


NOTHING_HELD = Held({}, frozenset(), {}, {}, {})


class _Tree(NamedTuple):
  axes: Axes
  leaves: int
  leaf_bytes: int          # what the producers' all-reduces would have moved
  bytes: int               # per device bytes of this value
  held: tuple              # values of the tree below this one
  ops: tuple               # ops of the tree that read held values
  stacked: tuple = ()      # (value, tree) where it passed out of a loop as a stacked output


def _keeps_partial(op, values) -> bool:
  """Whether `op` is linear in its operands without growing them."""
  if len(op.outputs) != 1:
    return False
  if op.name in JOINING or (op.name == "select_n" and len(op.inputs) == 3):
    return True   # a select keeps a sum where its other case is zeros (checked by `defer`)
  if op.name not in PASSING or len(op.inputs) != 1:
    return False
  if op.name == "convert_element_type":
    a, b = values[op.inputs[0]].dtype, values[op.outputs[0]].dtype
    return a.kind == b.kind == "f" and a.itemsize == b.itemsize
  return True


def _through_cast(program, v, link: dict) -> None:
  """Links the operand of the float conversion that makes `v` to it, where `v` is summed over
  a loop: a gradient computed in bf16 for float32 master weights is then accumulated in float32,
  as gradient accumulation does, and reduced once. (Elsewhere a widening cast ends a held
  sum: holding it wider would only move more bytes.)"""
  values, users, ops = program.values, program.users, program.ops
  i = values[v].producer
  if i is None or ops[i].name != "convert_element_type" or len(ops[i].inputs) != 1:
    return
  u = ops[i].inputs[0]
  made = values[u].producer
  if (_is_float(values[u].dtype) and _is_float(values[v].dtype) and users[u] == (i,) and
      u not in program.outputs and made is not None and
      program.region_of[made] == program.region_of[i]):
    link[u] = i


def _is_float(dtype) -> bool:
  return dtype.kind == "f" or "float" in dtype.name   # bfloat16 is a numpy extension type


def _is_zeros(program, v) -> bool:
  """Whether value v is made by broadcasting a constant zero."""
  op = program.ops[program.values[v].producer] if program.values[v].producer is not None else None
  if op is None or op.name != "broadcast_in_dim":
    return False
  source = program.values[op.inputs[0]]
  return source.is_const and not np.any(np.asarray(source.const))


class _Carry(NamedTuple):
  """A loop carry that accumulates partial sums: `acc = acc + partial` in the body."""
  exit: int        # the loop's exit op
  position: int    # the carry's position
  carry: int       # the body's view of the carry (the enter op's result)
  zeros: int       # its initial value, zeros


@per_program
def links(program) -> tuple[dict, tuple, dict, dict]:
  """What does not depend on the shardings: per value that could be held, the op that would
  carry it on (its only reader, linear in it, in the same loop body); the ops whose result is
  such a value; per new carry of a loop that adds to a carry starting at zeros, that
  carry (a sum over the iterations can stay partial until the loop ends); and per value a loop
  stacks (its exit op's only read of it) whose stack only a linear op reads, its position
  at the exit (a gradient per layer, summed into a carry of an enclosing loop)."""
  values, users, ops = program.values, program.users, program.ops
  region_of = program.region_of if program.regions else None
  outputs = set(program.outputs)
  link = {}
  for op in ops:
    if not _keeps_partial(op, values):
      continue
    j = op.index
    for v in op.inputs:
      i = values[v].producer
      if (i is not None and users[v] == (j,) and v not in outputs and
          len(ops[i].outputs) == 1 and (region_of is None or region_of[i] == region_of[j])):
        link[v] = j
  carries = {}
  for region in program.regions:
    enter, exit_ = ops[region.enter], ops[region.exit]
    for k in range(region.num_carry):
      c, new, init = enter.outputs[k], exit_.inputs[k], enter.inputs[k]
      j = values[new].producer
      if (j is None or ops[j].name not in JOINING or users[c] != (j, exit_.index) or
          users[new] != (exit_.index,) or users[init] != (enter.index,) or
          not _is_zeros(program, init)):
        continue
      link[c] = j
      carries[new] = _Carry(exit_.index, k, c, init)
      for w in ops[j].inputs:   # a sum cast up to be accumulated is held through the cast
        while values[w].producer is not None:   # and through selects of it and zeros
          op = ops[values[w].producer]
          if op.name == "convert_element_type":
            _through_cast(program, w, link)
          elif op.name != "select_n" or len(op.inputs) != 3:
            break
          else:
            cases = [v for v in op.inputs[1:] if not _is_zeros(program, v)]
            if len(cases) != 1:
              break
            w = cases[0]
            continue
          w = op.inputs[0]
  stacks = {}
  for r, region in enumerate(program.regions):
    exit_ = ops[region.exit]
    n = region.num_carry
    for k in range(n, len(exit_.outputs)):
      v, out = exit_.inputs[k], exit_.outputs[k]
      i = values[v].producer
      readers = users[out]
      if (i is None or users[v] != (exit_.index,) or v in outputs or out in outputs or
          region_of[i] != r or len(readers) != 1 or
          not (_keeps_partial(ops[readers[0]], values) or link.get(out) == readers[0]) or
          region_of[readers[0]] != region_of[exit_.index]):
        continue
      link[v], link[out], stacks[v] = exit_.index, readers[0], k
      _through_cast(program, v, link)
  looped = {t.carry for t in carries.values()}
  producers = tuple(sorted({values[v].producer for v in link if v not in looped and
                            ops[values[v].producer].primitive is not SCAN_EXIT}))
  return link, producers, carries, stacks


def accumulators(state, max_bytes: int) -> list[tuple[int, ...]]:
  """The loops' partial-sum accumulators of at most `max_bytes`: (initial zeros, the carry in
  the body, the new carry) each. ZeRO keeps them whole over its axis, so that the sum is
  reduced once after the loop rather than reduce-scattered into a shard in every iteration."""
  values = state.program.values
  return [(c.zeros, c.carry, new) for new, c in links(state.program)[2].items()
          if math.prod(values[new].shape) * values[new].dtype.itemsize <= max_bytes]


def _unstacked(parts: dict) -> tuple:
  """What a tree joining `parts` falls back to if it is not held: the trees its stacked parts
  were before they were stacked, and its other parts as they are (none if nothing in it was
  stacked)."""
  if not any(t.stacked for t in parts.values()):
    return ()
  return sum((t.stacked if t.stacked else ((v, t),) for v, t in parts.items()), ())


def defer(state, ops: list, communicating: list) -> tuple[list, list, Held]:
  """The op plans with partial sums deferred where that saves, the ops that then communicate,
  and what is held partial. `ops` and `communicating` are the plans before deferral."""
  program, sizes = state.program, state.sizes
  values, program_ops = program.values, program.ops
  link, producers, carries, stacks = links(state.program)
  trees: dict[int, _Tree] = {}
  for t in carries.values():   # zeros to begin with: a partial sum over any axes
    trees[t.carry] = _Tree(None, 0, 0, 0, (), ())
  roots: dict[int, _Carry] = {}   # final carry -> the loop carry it ends
  readers: list[int] = []
  for i in producers:
    p = ops[i]
    if not p.writes or not p.result[0].partial or p.result[0].reduce != "sum":
      continue
    steps = p.result_steps[0]
    if len(steps) != 1 or steps[0].kind != ALL_REDUCE:
      continue
    v = program_ops[i].outputs[0]
    trees[v] = _Tree(steps[0].axes, 1, steps[0].bytes, steps[0].bytes, (), ())
    readers.append(link[v])
  if not trees:
    return ops, communicating, NOTHING_HELD
  heapq.heapify(readers)
  seen = set()
  while readers:
    j = heapq.heappop(readers)
    if j in seen:
      continue
    seen.add(j)
    op, p = program_ops[j], ops[j]
    if op.primitive is SCAN_EXIT:   # sums per iteration, stacked: each position on its own
      for v in op.inputs:
        t, k = trees.get(v), stacks.get(v)
        if t is None or k is None or p.operand_steps[k] or p.result_steps[k]:
          continue
        out = op.outputs[k]
        trees[out] = t._replace(
            bytes=math.prod(local_shape(values[out].shape, state.dims[out], sizes)) *
            values[out].dtype.itemsize, held=t.held + (v,), stacked=((v, t),))
        trees[v] = None
        heapq.heappush(readers, link[out])
      continue
    summed = op.inputs
    if op.name == "select_n":   # select(mask, zeros, sum): the sum where the mask says
      summed = [v for v in op.inputs[1:] if trees.get(v) is not None]
      if (len(summed) != 1 or op.inputs[0] in trees or
          not all(_is_zeros(program, v) for v in op.inputs[1:] if v != summed[0])):
        continue
    parts = [trees.get(v) for v in summed]
    if None in parts:
      continue
    axes = {t.axes for t in parts} - {None}
    if (len(axes) != 1 or p.result[0].partial or p.result_steps[0] or any(p.operand_steps) or
        any(link.get(v) != j for v in summed)):
      continue
    out = op.outputs[0]
    distinct = {v: trees[v] for v in summed}
    trees[out] = _Tree(axes.pop(), sum(t.leaves for t in distinct.values()),
                       sum(t.leaf_bytes for t in distinct.values()),
                       math.prod(local_shape(values[out].shape, state.dims[out], sizes)) *
                       values[out].dtype.itemsize,
                       sum((t.held + (v,) for v, t in distinct.items()), ()),
                       sum((t.ops for t in distinct.values()), (j,)),
                       _unstacked(distinct))
    for v in op.inputs:
      trees[v] = None   # below a root now
    if out in link:
      heapq.heappush(readers, link[out])
    carry = carries.get(out)
    if (carry is not None and trees[out].leaves and carry.carry in trees[out].held and
        not ops[carry.exit].operand_steps[carry.position]):
      # The loop's sum stays partial to its end: reduced once after it, not per iteration.
      t = trees.pop(out)
      final = program_ops[carry.exit].outputs[carry.position]
      trees[final] = t._replace(held=t.held + (out,))
      roots[final] = carry
  held_values, held_ops, held_carries, zeros = {}, {}, {}, {}
  candidates = list(trees.items())
  while candidates:
    root, t = candidates.pop()
    if t is None:
      continue
    if t.stacked and root not in roots:
      # A stack is held only to be summed over an enclosing loop; otherwise each iteration's
      # tree stands as it was before it was stacked.
      candidates += list(t.stacked)
      continue
    if not t.ops or not (root in roots or t.leaves > 1 or t.bytes < t.leaf_bytes):
      continue
    held_values.update((v, t.axes) for v in t.held)
    held_ops.update((j, t.axes) for j in t.ops)
    if root in roots:
      carry = roots[root]
      held_carries.setdefault(carry.exit, {})[carry.position] = t.axes
      zeros[carry.zeros] = t.axes
  if not held_values:
    return ops, communicating, NOTHING_HELD
  ops = list(ops)
  looped = {t.carry for t in carries.values()}
  leaves = frozenset(values[v].producer for v in held_values if v not in looped and
                     program_ops[values[v].producer].primitive is not SCAN_EXIT) - set(held_ops)
  for i in leaves:
    ops[i] = ops[i]._replace(result_steps=((),), writes=())
  for i, positions in held_carries.items():
    p, out = ops[i], program_ops[i].outputs
    result, steps = list(p.result), list(p.result_steps)
    for k, axes in positions.items():
      result[k] = Sharding(result[k].dims, axes)
      steps[k] = reshard_steps(values[out[k]].shape, values[out[k]].dtype.itemsize,
                               result[k].dims, axes, "sum", state.dims[out[k]], sizes)
    ops[i] = p._replace(result=tuple(result), result_steps=tuple(steps), writes=result_writes(steps))
  for j, axes in held_ops.items():
    out = program_ops[j].outputs[0]
    local = ops[j].result[0]
    steps = () if out in held_values else reshard_steps(
        values[out].shape, values[out].dtype.itemsize, local.dims, axes, "sum",
        state.dims[out], sizes)
    ops[j] = ops[j]._replace(result=(Sharding(local.dims, axes),), result_steps=(steps,),
                             writes=result_writes((steps,)))
  # A leaf stays in `communicating`: its work is split over the axes it leaves partial.
  communicating = sorted(set(communicating) | {j for j in held_ops if ops[j].communicates} |
                         set(held_carries))
  return ops, communicating, Held(held_values, leaves, held_ops, held_carries, zeros)

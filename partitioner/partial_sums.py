"""Deferred partial sums: a sum left partial by its producer is carried through linear ops and
reduced once, where the partial sums meet, as Shardy keeps a value unreduced until it must be.

A value whose producer would reduce it with one all-reduce over axes P is *held* partial
instead when its only reader is linear in it and keeps it so: an add of values held partial
over the same axes (the input gradient of separate Q, K and V projections, the gradient of a
weight read twice such as a tied embedding), or a reshape, transpose, squeeze, copy,
negation, same-width float conversion or local reduce_sum of it, a select of it and zeros
(a pipeline's sums, kept for the stage that made them), or a scatter-add of it into a held
sum (an interleaved pipeline adding each stage's chunk of gradients to its own rows). The
reader's result is then partial over P in its turn, and the all-reduce moves there. A tree of
such ops is kept only where it saves: it joins two or more partial sums, or its root is
smaller than the sum it started from. Everywhere else each sum is reduced by its producer, as
before.

A loop whose carry starts at zeros and adds a partial sum in every iteration (the gradient
of a weight a recurrence reads at every time step) keeps the carry partial: one all-reduce
after the loop replaces one per iteration. So does an inner loop's stacked output of
per-iteration partial sums that such a carry of an enclosing loop adds up (a scanned layer
stack's gradients, summed over micro-batches: `microbatch.py`), and a float cast up on the
way into either (bf16 gradients of float32 master weights are summed in float32). An
accumulator may also start from what an earlier loop or the loop around it summed, and be
carried on by the loops inside it: a pipeline's loops, and loops of loops, carry one set of
gradients from the first to the last, reduced once after it.

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
from partitioner.ir import SCAN_ENTER, SCAN_EXIT, per_program
from partitioner.sharding import Axes, Sharding, local_shape

# Linear in every operand: each must be held partial over the same axes.
JOINING = frozenset({"add", "add_any", "sub"})
# Linear in its operand and updates (not its indices): `summed` says which operands.
ADDING = frozenset({"scatter-add"})
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
  finals: tuple = ()       # final carries of the loops whose sums it holds to their end


def summed(op) -> tuple:
  """The operands an op that keeps partial sums is linear in."""
  return (op.inputs[0], op.inputs[2]) if op.name in ADDING else tuple(op.inputs)


def _keeps_partial(op, values) -> bool:
  """Whether `op` is linear in its operands without growing them."""
  if len(op.outputs) != 1:
    return False
  if op.name in JOINING or op.name in ADDING or (op.name == "select_n" and len(op.inputs) == 3):
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
  """A loop carry that accumulates partial sums: `acc = acc + partial` in the body, or an
  inner loop's such carry that starts from it and becomes its new value."""
  exit: int        # the loop's exit op
  position: int    # the carry's position
  carry: int       # the body's view of the carry (the enter op's result)
  zeros: int       # its initial value: zeros, or (not `fresh`) a sum made before the loop
  fresh: bool = True


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
    for v in summed(op):
      i = values[v].producer
      if (i is not None and users[v] == (j,) and v not in outputs and
          len(ops[i].outputs) == 1 and (region_of is None or region_of[i] == region_of[j])):
        link[v] = j
  carries = {}
  exit_of = {r.enter: r.exit for r in program.regions}

  def read_by(v) -> tuple:
    """The ops that read `v`, but the exit of the loop whose carry it is (which passes it)."""
    p = values[v].producer
    own = exit_of.get(p) if p is not None and ops[p].primitive is SCAN_ENTER else None
    return tuple(u for u in users[v] if u != own)

  def started_from(x, c) -> bool:
    """Whether `x` is the final sum of inner loops' accumulators, one starting from the
    other's, the first from `c`."""
    while values[x].producer is not None and ops[values[x].producer].primitive is SCAN_EXIT:
      exit_op = ops[values[x].producer]
      inner = carries.get(exit_op.inputs[exit_op.outputs.index(x)])
      if inner is None or inner.fresh:
        return False
      x = inner.zeros
    return x == c

  # Inner loops first: an outer loop's accumulator may be one its inner loops carry on.
  for region in sorted(program.regions, key=lambda r: -r.enter):
    enter, exit_ = ops[region.enter], ops[region.exit]
    for k in range(region.num_carry):
      c, new, init = enter.outputs[k], exit_.inputs[k], enter.inputs[k]
      j = values[new].producer
      if j is None or users[new] != (exit_.index,) or read_by(init) != (enter.index,):
        continue
      fresh = _is_zeros(program, init)
      made = values[init].producer
      if not fresh and (made is None or ops[made].primitive not in (SCAN_ENTER, SCAN_EXIT)):
        continue   # only zeros, or what an enclosing or earlier loop summed, can be held on
      adds = (ops[j].name in JOINING | ADDING and c in summed(ops[j]) and
              users[c] == (j, exit_.index))
      if not adds and not (ops[j].primitive is SCAN_EXIT and len(read_by(c)) == 1 and
                           started_from(new, c)):
        continue
      if not fresh:   # starts from a sum made before the loop: held on into it
        link[init] = enter.index
      carries[new] = _Carry(exit_.index, k, c, init, fresh)
      if not adds:
        link[c] = read_by(c)[0]   # the inner loop that carries it on
        continue
      link[c] = j
      for w in summed(ops[j]):   # a sum cast up to be accumulated is held through the cast
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
  for new, t in carries.items():   # a loop's sum added on into another sum after it
    final = ops[t.exit].outputs[t.position]
    readers = users[final]
    if (len(readers) == 1 and final not in outputs and
        ops[readers[0]].name in JOINING | ADDING and final in summed(ops[readers[0]]) and
        region_of[readers[0]] == region_of[t.exit]):
      link[final] = readers[0]
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
  readers: list[int] = []
  for t in carries.values():   # zeros to begin with: a partial sum over any axes
    if t.fresh:
      trees[t.carry] = _Tree(None, 0, 0, 0, (), ())
      if program_ops[link[t.carry]].primitive is SCAN_ENTER:
        readers.append(link[t.carry])   # an inner loop carries it on
  roots: dict[int, _Carry] = {}   # final carry -> the loop carry it ends
  alone: dict[int, _Tree] = {}    # final carry -> its tree, were it reduced after its loop
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
    op = program_ops[j]
    if op.primitive is SCAN_ENTER:   # accumulators that start from the sums held so far
      for k, v in enumerate(op.inputs[:op.params["num_carry"]]):
        t, c = trees.get(v), op.outputs[k]
        if t is not None and link.get(v) == j and c not in trees:
          trees[c], trees[v] = t._replace(held=t.held + (v,)), None
          if c in link and program_ops[link[c]].primitive is SCAN_ENTER:
            heapq.heappush(readers, link[c])   # an inner loop carries it on
      continue
    if j in seen:
      continue
    seen.add(j)
    p = ops[j]
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
    added = summed(op)
    if op.name == "select_n":   # select(mask, zeros, sum): the sum where the mask says
      added = [v for v in op.inputs[1:] if trees.get(v) is not None]
      if (len(added) != 1 or op.inputs[0] in trees or
          not all(_is_zeros(program, v) for v in op.inputs[1:] if v != added[0])):
        continue
    parts = [trees.get(v) for v in added]
    if None in parts:
      continue
    axes = {t.axes for t in parts} - {None}
    if (len(axes) != 1 or p.result[0].partial or p.result_steps[0] or any(p.operand_steps) or
        any(link.get(v) != j for v in added)):
      continue
    out = op.outputs[0]
    distinct = {v: trees[v] for v in added}
    trees[out] = _Tree(axes.pop(), sum(t.leaves for t in distinct.values()),
                       sum(t.leaf_bytes for t in distinct.values()),
                       math.prod(local_shape(values[out].shape, state.dims[out], sizes)) *
                       values[out].dtype.itemsize,
                       sum((t.held + (v,) for v, t in distinct.items()), ()),
                       sum((t.ops for t in distinct.values()), (j,)),
                       _unstacked(distinct), sum((t.finals for t in distinct.values()), ()))
    for v in added:
      trees[v] = None   # below a root now
    if out in link:
      heapq.heappush(readers, link[out])
    carry, final = carries.get(out), None
    while (carry is not None and trees[out].leaves and carry.carry in trees[out].held and
           not ops[carry.exit].operand_steps[carry.position]):
      # The loop's sum stays partial to its end: reduced once after it, not per iteration
      # (and on through the loops around it that carry it on).
      t = trees.pop(out)
      final = program_ops[carry.exit].outputs[carry.position]
      trees[final] = t._replace(held=t.held + (out,), finals=t.finals + (final,),
                                stacked=())   # a stack summed over the loop: held for good
      roots[final] = carry
      alone[final] = trees[final]
      out, carry = final, carries.get(final)
    if final is not None:
      carry = roots[final]
      if final in link and ops[carry.exit].result[carry.position].dims == state.dims[final]:
        # Added on into another sum after the loop, which reads it laid out as the loop
        # holds it (not reduce-scattered into a ZeRO shard): held through.
        heapq.heappush(readers, link[final])
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
      candidates += [(f, alone[f]) for f in t.finals if f != root]   # each loop's own
      continue
    held_values.update((v, t.axes) for v in t.held)
    held_ops.update((j, t.axes) for j in t.ops)
    for final in t.finals:   # every loop whose sum it holds, this root's own among them
      carry = roots[final]
      held_carries.setdefault(carry.exit, {})[carry.position] = t.axes
      if carry.fresh:
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
      steps[k] = () if out[k] in held_values else reshard_steps(   # held on after the loop
          values[out[k]].shape, values[out[k]].dtype.itemsize, result[k].dims, axes, "sum",
          state.dims[out[k]], sizes)
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

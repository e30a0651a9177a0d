"""Peak memory per device by liveness over program order.

Buffers are the stored (local) values: inputs live for the whole step; with donation (the
default for a training step) an updated parameter or optimizer state shares its input's buffer,
so state counts once; without it the new state is a buffer of its own. Intermediates live from
the op that makes them to their last reader (a loop's body holds its values for one iteration at
a time; what it reads from outside lives to the loop's end; stacked outputs are allocated before
the first iteration); values inside a fused kernel never exist, and neither do the values XLA
computes inside every kernel that reads them (`bufferless`: reshapes, broadcasts, one-operand
conversions, a slice taking back a part of a concatenation), whose source lives on instead.
Resharded copies (a gathered parameter) live from the first to the last op that reads them,
and a partial result lives while it is being reduced.
At the peak the live bytes are split into parameters, optimizer state, batch, activations kept
for the backward pass (made in the forward pass, read after it) and temporaries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import roles as R
from partitioner.cost.compute import BARRIER, ProgramWork

CATEGORIES = ("parameters", "optimizer_state", "batch", "activations", "temporaries")


class MemoryReport(NamedTuple):
  peak_bytes: int
  peak_op: int                 # op running at the peak (number of ops: after the last)
  breakdown: dict              # category -> bytes live at the peak
  argument_bytes: int          # inputs, per device
  output_bytes: int            # outputs, per device (aliased state included)
  temp_bytes: int              # peak of everything but inputs and outputs
  capacity_bytes: int
  fits: bool


class _Side(NamedTuple):
  """Where the w - 1 extra buffers of a folded value are made and dropped, on one side of the
  middle block (the last middle layer, or the first)."""
  starts: np.ndarray
  ends: np.ndarray
  index: np.ndarray          # starts, then ends + 1: where they add and remove bytes
  temp_index: np.ndarray     # the same for the temporaries among them


class ProgramLiveness:
  """Birth, death and category of every value, and the fixed index arrays the profile adds
  bytes at; computed once per program (and folding)."""

  def __init__(self, program, work: ProgramWork, donate: bool = True, folding=None):
    n_ops = len(program.ops)
    roles = R.roles(program)
    self.n_ops = n_ops
    birth = np.full(len(program.values), -1, np.int64)
    death = np.full(len(program.values), -2, np.int64)  # -2: never a buffer
    users, values = program.users, program.values
    for v in program.values:
      if v.producer is not None and not work.internal[v.id] and not v.is_const:
        birth[v.id] = v.producer   # read until the last kernel that computes a reader
        death[v.id] = max((int(work.last_run[u]) for u in users[v.id]), default=v.producer)
    for region in program.regions:
      # A loop's stacked outputs are allocated before its first iteration; a value made
      # outside a loop and read in its body lives until the loop ends.
      enter, exit_ = program.ops[region.enter], program.ops[region.exit]
      for v in exit_.outputs[region.num_carry:]:
        birth[v] = min(birth[v], region.enter) if birth[v] >= 0 else birth[v]
      for v in enter.inputs[region.num_carry:]:   # sliced in every iteration
        if death[v] >= -1:
          death[v] = max(death[v], region.exit)
      for op in program.ops[region.enter + 1:region.exit]:
        for v in op.inputs:
          if death[v] >= -1:
            death[v] = max(death[v], program.hoist(op.index, program.values[v].producer)[1])
    for region in program.regions:
      # A carry keeps one buffer all around its loop, as XLA's while loops do: the exit op
      # reads the carry the enter op made only to keep its layout, and the final carry is the
      # last iteration's, in the buffer that iteration wrote it to.
      enter, exit_ = program.ops[region.enter], program.ops[region.exit]
      for j in range(region.num_carry):
        inner, back, final = enter.outputs[j], exit_.inputs[j], exit_.outputs[j]
        if back == inner or death[inner] < -1:
          continue
        death[inner] = max((int(work.last_run[u]) for u in users[inner] if u != region.exit),
                           default=region.enter)
        made = values[back].producer
        if (made is not None and region.enter < made < region.exit and death[back] >= -1
            and death[final] >= -1 and final not in program.outputs):
          death[back], death[final] = max(death[back], death[final]), -2
    for v in program.inputs:
      birth[v], death[v] = -1, n_ops
    aliased_outputs = {program.outputs[o] for o in program.aliases}
    for v in program.outputs:
      if donate and v in aliased_outputs and v not in program._input_pos:
        death[v] = -2  # written into its input's buffer (donation)
      elif death[v] != -2 or v in program._input_pos:
        death[v] = n_ops
    roots = bufferless(program, work.internal)
    for v, r in roots.items():       # a stored value lives as long as what is computed from it
      if r >= 0 and death[v] >= -1 and death[r] >= -1:
        death[r] = max(death[r], death[v])
      death[v] = -2
    readers = readers_with_views(program, roots)
    self.birth, self.death = birth, death
    category = np.full(len(program.values), 4, np.int8)
    forward = R.forward_ops(program)
    for v in program.values:
      if v.producer is not None and v.producer in forward and any(
          u not in forward for u in readers[v.id]):
        category[v.id] = 3
    for group, code in ((roles.weights, 0), (roles.opt_state, 1)):
      for v in group:
        category[v] = code
        for o in R.aliased_outputs(program, v):
          category[o] = code
    for v in program.inputs:
      if category[v] == 4:
        category[v] = 2
    self.category = category
    is_input = np.zeros(len(program.values), bool)
    is_input[list(program.inputs)] = True
    is_output = np.zeros(len(program.values), bool)
    is_output[list(program.outputs)] = True
    self.buffers = np.nonzero(death >= -1)[0]
    self.start = np.maximum(birth[self.buffers], 0)
    self.end = death[self.buffers]
    self.buffer_category = category[self.buffers]
    self.buffer_kind = np.where(is_input[self.buffers], 0,
                                np.where(is_output[self.buffers], 1, 2)).astype(np.int8)
    self.outputs = np.array(program.outputs, np.int64)
    self.value_bytes = work.value_bytes
    self.value_nbytes = np.array([v.nbytes for v in program.values], np.int64)
    # Buffers by kind: temporaries (neither inputs nor outputs) and the rest.
    self.temp = np.nonzero(self.buffer_kind == 2)[0]
    self.fixed = np.nonzero(self.buffer_kind != 2)[0]
    self.temp_index = np.concatenate([self.start[self.temp], self.end[self.temp] + 1])
    self.fixed_index = np.concatenate([self.start[self.fixed], self.end[self.fixed] + 1])
    self.fixed_input = np.nonzero(self.buffer_kind[self.fixed] == 0)[0]
    self.folding = folding
    if folding is not None:
      self.fold = fold = folding.buffers(work.last_run, work.internal)
      weight = fold.value_weight[self.buffers]
      self.many = np.nonzero(weight > 1)[0]              # buffers standing for several
      self.many_values, self.many_extra = self.buffers[self.many], weight[self.many] - 1
      self.many_temp = np.nonzero(self.buffer_kind[self.many] == 2)[0]
      self.many_input = np.nonzero(self.buffer_kind[self.many] == 0)[0]
      self.sides = []
      for side in (0, 1):   # the last middle layer, the first
        made = fold.made_in[self.many_values, side]
        dropped = fold.dropped_in[self.many_values, side]
        s = np.where(made >= 0, made + side, self.start[self.many])   # made before or after it
        e = np.where(dropped >= 0, dropped + side - 1, self.end[self.many])   # dropped likewise
        e = np.maximum(e, s - 1)
        t = self.many_temp
        self.sides.append(_Side(s, e, np.concatenate([s, e + 1]),
                                np.concatenate([s[t], e[t] + 1])))


VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})
# Elementwise ops XLA's fusion duplicates into each kernel that reads their result (it never
# duplicates exp, log, tanh, divide, sqrt and the like).
CHEAP = frozenset("""neg sign floor ceil round abs not convert_element_type reduce_precision
stop_gradient copy square integer_pow add add_any sub mul max min and or xor eq ne lt le gt ge
select_n clamp""".split())


def bufferless(program, internal=None) -> dict[int, int]:
  """Values XLA gives no buffer of their own, each mapped to the stored value it is computed
  from (-1: to none, it is never made): a reshape is a bitcast of its operand; a broadcast,
  and a slice or a cheap elementwise op of one operand (the others constants: x * 2, -x,
  x > 0, a dtype conversion) read only by ops that fuse it, are recomputed in every kernel that
  reads them; a slice that takes one part back out of a concatenation is that part, and a
  concatenation read only by such slices is never made; an optimization barrier's results are
  its operands. (Cheap ops of two operands are stored:
  recomputing them too matched XLA on data parallelism but under-predicted Megatron layouts by
  up to 20%.) Results the step returns and values crossing a loop boundary keep their
  buffers, and so does a value made from one that is `internal` (per value: computed inside a
  kernel, never stored): a concatenation or a bias reshaped is what its kernel writes."""
  from partitioner.cost.compute import FUSIBLE
  region, users, values = program.region_of, program.users, program.values
  outputs = set(program.outputs)
  root: dict[int, int] = {}
  for op in program.ops:
    if op.name == BARRIER:   # each result is its operand
      for v, source in zip(op.outputs, op.inputs):
        made = values[source].producer
        if v not in outputs and (made is None or region[made] == region[op.index]):
          root[v] = root.get(source, source)
      continue
    if len(op.outputs) != 1 or op.outputs[0] in outputs:
      continue
    v = op.outputs[0]
    part = _whole_part(program, op) if op.name == "slice" else None
    if op.name in VIEWS:
      source = op.inputs[0]
    elif part is not None:
      source = part
    elif (op.name in CHEAP or op.name == "slice") and users[v] and all(
        program.ops[u].name in FUSIBLE for u in users[v]):
      sources = [i for i in op.inputs if not values[i].is_const]
      if len(sources) != 1:
        continue
      source = sources[0]
    else:
      continue
    made = values[source].producer
    if made is not None and region[made] != region[op.index]:
      continue
    if internal is not None and internal[root.get(source, source)]:
      continue
    root[v] = root.get(source, source)
  for op in program.ops:
    out = op.outputs[0] if op.outputs else -1
    if op.name == "concatenate" and users[out] and all(
        program.ops[u].name == "slice" and root.get(program.ops[u].outputs[0], out) != out
        for u in users[out]):
      root[out] = -1
  return root


def _whole_part(program, op):
  """The part of a concatenation that `op`, a slice of it, takes back whole, or None (XLA
  rewrites such a slice to the part: a stack of per-layer values sliced layer by layer)."""
  made = program.values[op.inputs[0]].producer
  if made is None or program.ops[made].name != "concatenate":
    return None
  concat = program.ops[made]
  dim = concat.params["dimension"]
  start, limit = op.params["start_indices"], op.params["limit_indices"]
  if op.params.get("strides") not in (None, (1,) * len(start)):
    return None
  shape = program.values[op.inputs[0]].shape
  if any(d != dim and (start[d], limit[d]) != (0, shape[d]) for d in range(len(shape))):
    return None
  offset = 0
  for part in concat.inputs:
    size = program.values[part].shape[dim]
    if (start[dim], limit[dim]) == (offset, offset + size):
      return part
    offset += size
  return None


def readers_with_views(program, roots: dict[int, int]) -> list[tuple[int, ...]]:
  """Per value, the ops that read it directly or through a value computed from it."""
  readers = [tuple(r) for r in program.users]
  for v, r in roots.items():
    if r >= 0:
      readers[r] = tuple(sorted({*readers[r], *program.users[v]}))
  return readers


def memory(live: ProgramLiveness, divisors: np.ndarray, copies, staged,
           capacity: int) -> MemoryReport:
  """`divisors`: per value, into how many pieces it is cut; `copies`: per resharded copy, arrays
  (value, pieces, op before which it is made, last reader); `staged`: per result resharded out
  of place, arrays (op, value, pieces).

  With a folding (`live.folding`), a buffer standing for w of the deep program is one buffer
  over its own lifetime and w - 1 more that the middle block making or dropping it makes or
  drops all before it runs (as the deep program is when it runs its last middle layer) or all
  after it (its first middle layer); the peak is the larger of the two, and the deep program's
  peak while it runs a middle layer between those lies between them, as its live bytes are
  linear in the layer.

  Live bytes are a running sum of what each buffer adds at its start and removes after its
  end, one weighted bincount per group of buffers: the temporaries (resharded copies and
  staged results among them) and the rest, shared by both sides of a folding."""
  n = live.n_ops + 2
  per_value = np.floor(live.value_bytes / divisors)
  copy_value, copy_pieces, copy_start, copy_end = copies
  staged_op, staged_value, staged_pieces = staged
  held = per_value[live.buffers]
  copy_bytes = (live.value_nbytes[copy_value] // copy_pieces).astype(np.float64)
  staged_bytes = (live.value_nbytes[staged_value] // staged_pieces).astype(np.float64)
  temp, fixed = held[live.temp], held[live.fixed]
  temp_delta = np.bincount(
      np.concatenate([live.temp_index, copy_start, copy_end + 1, staged_op, staged_op + 1]),
      np.concatenate([temp, -temp, copy_bytes, -copy_bytes, staged_bytes, -staged_bytes]),
      minlength=n)
  delta = temp_delta + np.bincount(live.fixed_index, np.concatenate([fixed, -fixed]),
                                   minlength=n)
  argument_bytes = fixed[live.fixed_input].sum()
  outputs = per_value[live.outputs]
  if live.folding is None:
    totals = [np.cumsum(delta)[: n - 1]]
    temp_peak = np.cumsum(temp_delta)[: n - 1].max()
  else:
    more = per_value[live.many_values] * live.many_extra
    more_temp = more[live.many_temp]
    totals, temp_peak = [], 0.0
    for side in live.sides:
      totals.append(np.cumsum(delta + np.bincount(side.index, np.concatenate([more, -more]),
                                                  minlength=n))[: n - 1])
      temp_peak = max(temp_peak, np.cumsum(temp_delta + np.bincount(
          side.temp_index, np.concatenate([more_temp, -more_temp]), minlength=n))[: n - 1].max())
    argument_bytes += more[live.many_input].sum()
    outputs = outputs * live.fold.value_weight[live.outputs]
  which = int(np.argmax([t.max() for t in totals]))
  point = int(np.argmax(totals[which]))
  # What is live at the peak, by category.
  alive = (live.start <= point) & (live.end >= point)
  by_category = np.bincount(live.buffer_category[alive], held[alive], minlength=len(CATEGORIES))
  copy_category = live.category[copy_value]
  alive = (copy_start <= point) & (copy_end >= point)
  by_category += np.bincount(np.where(copy_category < 2, copy_category, 4)[alive],
                             copy_bytes[alive], minlength=len(CATEGORIES))
  by_category[4] += staged_bytes[staged_op == point].sum()
  if live.folding is not None:
    side = live.sides[which]
    alive = (side.starts <= point) & (side.ends >= point)
    by_category += np.bincount(live.buffer_category[live.many][alive], more[alive],
                               minlength=len(CATEGORIES))
  peak = int(totals[which][point])
  return MemoryReport(peak, point, {c: int(b) for c, b in zip(CATEGORIES, by_category)},
                      int(argument_bytes), int(outputs.sum()), int(temp_peak), capacity,
                      peak <= capacity)

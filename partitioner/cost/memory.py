"""Peak memory per device by liveness over program order.

Buffers are the stored (local) values: inputs live for the whole step; with donation (the
default for a training step) an updated parameter or optimizer state shares its input's buffer,
so state counts once; without it the new state is a buffer of its own. Intermediates live from the op that makes them to their last reader;
values inside a fused kernel never exist. Resharded copies (a gathered parameter) live from the
first to the last op that reads them, and a partial result lives while it is being reduced.
At the peak the live bytes are split into parameters, optimizer state, batch, activations kept
for the backward pass (made in the forward pass, read after it) and temporaries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import roles as R
from partitioner.cost.compute import ProgramWork

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


class ProgramLiveness:
  """Birth, death and category of every value; computed once per program."""

  def __init__(self, program, work: ProgramWork, donate: bool = True):
    n_ops = len(program.ops)
    roles = R.roles(program)
    self.n_ops = n_ops
    birth = np.full(len(program.values), -1, np.int64)
    death = np.full(len(program.values), -2, np.int64)  # -2: never a buffer
    users = program.users
    for v in program.values:
      if v.producer is not None and not work.internal[v.id] and not v.is_const:
        birth[v.id] = v.producer
        death[v.id] = max(users[v.id], default=v.producer)
    for v in program.inputs:
      birth[v], death[v] = -1, n_ops
    aliased_outputs = {program.outputs[o] for o in program.aliases}
    for v in program.outputs:
      if donate and v in aliased_outputs and v not in program._input_pos:
        death[v] = -2  # written into its input's buffer (donation)
      elif death[v] != -2 or v in program._input_pos:
        death[v] = n_ops
    self.birth, self.death = birth, death
    category = np.full(len(program.values), 4, np.int8)
    forward = R.forward_ops(program)
    for v in program.values:
      if v.producer is not None and v.producer in forward and any(
          u not in forward for u in users[v.id]):
        category[v.id] = 3
    for group, code in ((roles.params, 0), (roles.opt_state, 1)):
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


def memory(live: ProgramLiveness, divisors: np.ndarray, copies, staged,
           capacity: int, folding=None) -> MemoryReport:
  """`divisors`: per value, into how many pieces it is cut; `copies`: per resharded copy, arrays
  (value, pieces, op before which it is made, last reader); `staged`: per result resharded out
  of place, arrays (op, value, pieces).

  With a `folding`, a buffer standing for w of the deep program is one buffer over its own
  lifetime and w - 1 more that the middle block making or dropping it makes or drops all
  before it runs (as the deep program is when it runs its last middle layer) or all after it
  (its first middle layer); the peak is the larger of the two, and the deep program's peak
  while it runs a middle layer between those lies between them, as its live bytes are linear
  in the layer."""
  per_value = np.floor(live.value_bytes / divisors)
  copy_value, copy_pieces, copy_start, copy_end = copies
  staged_op, staged_value, staged_pieces = staged
  copy_category = live.category[copy_value]
  starts = np.concatenate([live.start, copy_start, staged_op])
  ends = np.concatenate([live.end, copy_end, staged_op])
  nbytes = np.concatenate([per_value[live.buffers],
                           live.value_nbytes[copy_value] // copy_pieces,
                           live.value_nbytes[staged_value] // staged_pieces]).astype(np.float64)
  cats = np.concatenate([live.buffer_category, np.where(copy_category < 2, copy_category, 4),
                         np.full(len(staged_op), 4, np.int8)])
  kinds = np.concatenate([live.buffer_kind, np.full(len(ends) - len(live.end), 2, np.int8)])
  scenarios = [(starts, ends, nbytes, cats, kinds)]
  if folding is not None:
    weight = folding.value_weight[live.buffers]
    many = np.nonzero(weight > 1)[0]
    v = live.buffers[many]
    more = per_value[v] * (weight[many] - 1)
    scenarios = []
    for side in (0, 1):   # the last middle layer, the first
      made, dropped = folding.made_in[v, side], folding.dropped_in[v, side]
      s = np.where(made >= 0, made + side, starts[many])        # made before or after the block
      e = np.where(dropped >= 0, dropped + side - 1, ends[many])   # dropped likewise
      e = np.maximum(e, s - 1)
      scenarios.append((np.concatenate([starts, s]), np.concatenate([ends, e]),
                        np.concatenate([nbytes, more]), np.concatenate([cats, cats[many]]),
                        np.concatenate([kinds, kinds[many]])))
  n = live.n_ops + 2

  def profile(starts, ends, nbytes, mask):
    """Live bytes at t = 0..n_ops (while op t runs; t = n_ops: after the last op)."""
    delta = (np.bincount(starts[mask], nbytes[mask], minlength=n) -
             np.bincount(ends[mask] + 1, nbytes[mask], minlength=n))
    return np.cumsum(delta)[: live.n_ops + 1]

  totals = [profile(s, e, b, slice(None)) for s, e, b, _, _ in scenarios]
  which = int(np.argmax([t.max() for t in totals]))
  starts, ends, nbytes, cats, kinds = scenarios[which]
  point = int(np.argmax(totals[which]))
  alive = (starts <= point) & (ends >= point)
  breakdown = {c: int(nbytes[alive & (cats == i)].sum()) for i, c in enumerate(CATEGORIES)}
  peak = int(totals[which][point])
  outputs = per_value[live.outputs]
  if folding is not None:
    outputs = outputs * folding.value_weight[live.outputs]
  temp = max(int(profile(s, e, b, k == 2).max()) for s, e, b, _, k in scenarios)
  return MemoryReport(peak, point, breakdown, int(nbytes[kinds == 0].sum()), int(outputs.sum()),
                      temp, capacity, peak <= capacity)

"""Factor rules of the two ends of a loop region (`ir.SCAN_ENTER`, `ir.SCAN_EXIT`).

A carry's dimensions are one set of pass-through factors shared by the initial carry, the
carry of an iteration, the carry the body makes and the final carry, so a layout reaches around
the loop. A stacked input or output shares its per-iteration dimensions with the slice the
body reads or makes; its leading (iteration) dimension is a factor of its own that is never
sharded: every device runs every iteration. The carries and stacked values are independent
of each other, so each is a factor group of its own (one mesh axis may shard them all).
"""

from __future__ import annotations

from partitioner.factors import REPL, FactorBuilder
from partitioner.rules import factor_rule, shapes_of


class _Grouped(FactorBuilder):
  """A builder that tags each new factor with the current group."""

  def __init__(self):
    super().__init__()
    self.group, self.groups = 0, []

  def new(self, size, kind=0):
    self.groups.append(self.group)
    return super().new(size, kind)

  def tensor(self, per_iteration, stacked=None):
    """Factors of one carry or stacked value: the per-iteration dims, then (for a stacked
    value of that shape) its leading dimension."""
    dims = self.dims(per_iteration)
    lead = self.dims(stacked[:1], REPL)[0] if stacked is not None else None
    self.group += 1
    return dims, (lead,) + dims if stacked is not None else None


@factor_rule("scan_enter")
def _enter(op, program):
  n = op.params["num_carry"]
  b = _Grouped()
  operands, results = [], []
  for k, shape in enumerate(shapes_of(program, op.outputs)):
    stacked = program.values[op.inputs[k]].shape if k >= n else None
    per, whole = b.tensor(shape, stacked)
    operands.append(per if k < n else whole)
    results.append(per)
  return b.build(operands, results, b.groups)


@factor_rule("scan_exit")
def _exit(op, program):
  n = op.params["num_carry"]
  b = _Grouped()
  inputs = op.inputs[:len(op.inputs) - n]
  operands, results = [], []
  for k, shape in enumerate(shapes_of(program, inputs)):
    stacked = program.values[op.outputs[k]].shape if k >= n else None
    per, whole = b.tensor(shape, stacked)
    operands.append(per)
    results.append(per if k < n else whole)
  return b.build(operands + operands[:n], results, b.groups)

"""dot_general: batch and free factors pass through, contracting factors are summed.

`([b, i, k], [b, k, j]) -> ([b, i, j]) {k: sum}`: sharding a contracting factor leaves each
device with a partial product, which is the all-reduce (or reduce-scatter) of Megatron's
row-parallel layer and of data-parallel gradients.
"""

from partitioner.factors import PASS, SUM, FactorBuilder
from partitioner.rules import factor_rule


@factor_rule("dot_general")
def dot_general(op, program):
  (lc, rc), (lb, rb) = op.params["dimension_numbers"]
  ls = program.values[op.inputs[0]].shape
  rs = program.values[op.inputs[1]].shape
  b = FactorBuilder()
  lhs: list = [()] * len(ls)
  rhs: list = [()] * len(rs)
  out: list = []

  def pair(l, r, kind):
    f = (b.new(ls[l], kind),) if ls[l] > 1 else ()
    lhs[l] = rhs[r] = f
    return f

  for l, r in zip(lb, rb):
    out.append(pair(l, r, PASS))
  for l, r in zip(lc, rc):
    pair(l, r, SUM)
  for d in range(len(ls)):
    if d not in lc and d not in lb:
      lhs[d] = (b.new(ls[d]),) if ls[d] > 1 else ()
      out.append(lhs[d])
  for d in range(len(rs)):
    if d not in rc and d not in rb:
      rhs[d] = (b.new(rs[d]),) if rs[d] > 1 else ()
      out.append(rhs[d])
  return b.build([lhs, rhs], [out])

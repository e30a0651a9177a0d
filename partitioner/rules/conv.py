"""conv_general_dilated: batch and feature dimensions partition; spatial dimensions stay whole.

`([n, c, h..], [o, c, h'..]) -> ([n, o, h''..]) {c: sum}` for ungrouped convolutions, which is
also the form of their gradients (JAX swaps the dimension numbers rather than the data).
"""

from partitioner.factors import PASS, REPL, SUM, FactorBuilder
from partitioner.rules import Unsupported, factor_rule


@factor_rule("conv_general_dilated")
def conv(op, program):
  if op.params["feature_group_count"] != 1 or op.params["batch_group_count"] != 1:
    raise Unsupported("grouped convolution")
  lhs_spec, rhs_spec, out_spec = op.params["dimension_numbers"]
  ls = program.values[op.inputs[0]].shape
  rs = program.values[op.inputs[1]].shape
  os = program.values[op.outputs[0]].shape
  b = FactorBuilder()
  lhs, rhs, out = [()] * len(ls), [()] * len(rs), [()] * len(os)

  def maybe(size, kind):
    return (b.new(size, kind),) if size > 1 else ()

  lhs[lhs_spec[0]] = out[out_spec[0]] = maybe(ls[lhs_spec[0]], PASS)   # batch
  lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = maybe(ls[lhs_spec[1]], SUM)    # input features
  rhs[rhs_spec[0]] = out[out_spec[1]] = maybe(rs[rhs_spec[0]], PASS)  # output features
  for spec, shape, dims in ((lhs_spec, ls, lhs), (rhs_spec, rs, rhs), (out_spec, os, out)):
    for d in spec[2:]:
      dims[d] = maybe(shape[d], REPL)
  return b.build([lhs, rhs], [out])

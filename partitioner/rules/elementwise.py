"""Elementwise primitives: one shared factor per dimension; scalar operands broadcast."""

from partitioner.factors import FactorBuilder, elementwise_factors
from partitioner.rules import Unsupported, factor_rule, shapes_of

UNARY = """neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan
asin acos atan sinh cosh asinh acosh atanh lgamma digamma erf erfc erf_inv sqrt rsqrt cbrt abs not
population_count clz real imag conj integer_pow convert_element_type reduce_precision stop_gradient
copy square bessel_i0e bessel_i1e sharding_constraint stage_view""".split()
NARY = """add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge shift_left
shift_right_arithmetic shift_right_logical add_any complex igamma igammac igamma_grad_a polygamma
zeta random_gamma_grad regularized_incomplete_beta select_n clamp threefry2x32""".split()


@factor_rule(*UNARY, *NARY)
def elementwise(op, program):
  ins, outs = shapes_of(program, op.inputs), shapes_of(program, op.outputs)
  shape = tuple(outs[0])
  for s in list(ins) + list(outs[1:]):
    if len(s) and (len(s) != len(shape) or any(n not in (m, 1) for n, m in zip(s, shape))):
      raise Unsupported(f"{op.name} with operands of incompatible shapes {ins}")
  return elementwise_factors(ins, outs)


# Ops whose result i is operand i, each pair independent of the others.
PER_OPERAND = ("device_put", "optimization_barrier")


@factor_rule(*PER_OPERAND)
def identity_per_operand(op, program):
  """Result i is operand i. Each pair is a factor group of its own: the operands are
  independent, so one mesh axis may shard them all (a rematerialised layer's activations and
  their cotangents, both along the batch)."""
  b = FactorBuilder()
  dims = [b.dims(program.values[v].shape) for v in op.inputs]
  groups = [k for k, d in enumerate(dims) for factor in d for _ in factor]
  return b.build(dims, dims, groups)

"""Reductions: a sharded reduced dimension leaves a partial result (sum, max or min)."""

from partitioner.factors import MAX, MIN, PASS, REPL, SUM, FactorBuilder
from partitioner.rules import factor_rule

_KIND = {"reduce_sum": SUM, "reduce_max": MAX, "reduce_min": MIN, "reduce_prod": REPL,
         "reduce_and": REPL, "reduce_or": REPL, "reduce_xor": REPL, "argmax": REPL, "argmin": REPL}


@factor_rule(*_KIND)
def reduce(op, program):
  src = program.values[op.inputs[0]].shape
  axes = {a % len(src) for a in op.params["axes"]}
  kind = _KIND[op.name]
  b = FactorBuilder()
  ins = [(b.new(n, kind if d in axes else PASS),) if n > 1 else () for d, n in enumerate(src)]
  return b.build([ins], [[f for d, f in enumerate(ins) if d not in axes]])

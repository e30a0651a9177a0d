"""Per-primitive sharding rules: factors for propagation, and how to run the op on one shard.

A factor rule `rule(op, program) -> OpFactors` may raise `Unsupported` for instances it cannot
partition (a grouped convolution, an unusual gather); those ops, like primitives with no rule at
all, fall back to replicated operands and are reported, so the program stays correct.

A local rule `rule(op, ctx, args) -> results` runs the op on per-device pieces inside
`shard_map`; primitives without one are bound unchanged, which is right whenever the op's
parameters do not spell out shapes.
"""

from __future__ import annotations

from typing import Callable

from partitioner.factors import OpFactors, replicated_factors

FACTOR_RULES: dict[str, Callable] = {}
LOCAL_RULES: dict[str, Callable] = {}


class Unsupported(Exception):
  """Raised by a factor rule for an instance of its primitive it cannot partition."""


def factor_rule(*names: str):
  def register(fn):
    for n in names:
      FACTOR_RULES[n] = fn
    return fn
  return register


def local_rule(*names: str):
  def register(fn):
    for n in names:
      LOCAL_RULES[n] = fn
    return fn
  return register


def shapes_of(program, ids):
  return [program.values[i].shape for i in ids]


def op_factors(op, program) -> tuple[OpFactors, str | None]:
  """The op's factors, and the reason it fell back to replication (None if it did not)."""
  rule = FACTOR_RULES.get(op.name)
  reason = None
  if rule is not None:
    try:
      return rule(op, program), None
    except Unsupported as e:
      reason = str(e) or f"unsupported {op.name}"
  else:
    reason = f"no sharding rule for primitive {op.name!r}"
  return replicated_factors(shapes_of(program, op.inputs), shapes_of(program, op.outputs)), reason


# Register the rule families.
from partitioner.rules import elementwise, dot_general, shapes, reductions, indexing, conv  # noqa: E402,F401
from partitioner.rules import loops, shift  # noqa: E402,F401


# Tracing turns every `scan` into straight-line code or a loop region (rules/loops.py), so only
# `while` and `cond` meet this rule ("scan" names the loop region's ends).
@factor_rule("scan", "while", "cond")
def _region(op, program):
  """Region ops keep their bodies whole for now: correct, but replicated."""
  raise Unsupported(f"region op {op.name!r} runs replicated: its body is not partitioned yet")

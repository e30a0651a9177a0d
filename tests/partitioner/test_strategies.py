"""The MLP and GPT training steps under the issue's five strategies on 8 CPU devices.

For each: both lowerings equal the unpartitioned program; the shard_map program compiles to
exactly the collectives of the plan; and the collectives XLA chooses for the jit program agree
with the plan within 10% per kind, except for differences explained below, each pinned to the
(kind, JAX primitive) it comes from. The plan gathers a ZeRO-3 parameter again for the
backward pass (as FSDP does); the jit lowering reads it there through an optimization barrier,
so that XLA's CSE does not keep the forward gather alive for the whole step instead.
"""

import collections
import functools

import jax
import numpy as np
import pytest

import corpus
import partitioner as P
from partitioner.hlo import hlo_collectives

STRATEGIES = {
    "batch8": ("batch=8", "BatchParallel(batch)"),
    "megatron8": ("model=8", "Megatron(model)"),
    "batch2_model4": ("batch=2,model=4", "BatchParallel(batch); Megatron(model)"),
    "zero3_batch8": ("batch=8", "ZeRO(batch, stage=3)"),
    "batch4_model2_zero1": ("batch=4,model=2",
                            "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1)"),
}

PERMUTE = ("XLA reorders shards with collective-permutes where the plan slices its local "
           "piece from data it already holds")

# (model, strategy) -> [(kind, source primitive, reason)]. Gathers and scatters run as the plan
# runs them in the jit lowering (one-op shard_map islands), so the differences XLA's own
# indexing made (it gathered take_along_axis's indices and reduced its results; for a ZeRO-3
# table it gathered token ids and reduced rows) are gone.
EXPLAINED = {
    ("gpt:small", "batch4_model2_zero1"): [("collective-permute", "add", PERMUTE),
                                           ("collective-permute", "mul", PERMUTE)],
}


@functools.lru_cache(maxsize=None)
def model(name):
  workload = corpus.load(name)
  program = P.trace(workload.fn, *workload.args)
  expected = jax.tree_util.tree_leaves(jax.jit(program.evaluate)(
      *jax.tree_util.tree_leaves(workload.args)))
  return workload, program, expected


def regathered(pp) -> set[int]:
  """Copies that remake, in the backward pass, a layout the forward pass already made."""
  seen, again = set(), set()
  for i, c in enumerate(pp.plan.copies):
    key = (c.value, c.dims)
    if key in seen:
      again.add(i)
    seen.add(key)
  return again


def by_source(collectives, program=None):
  """bytes per (kind, primitive); reduce-scatters count as all-reduces, as XLA:CPU emits an
  all-reduce followed by a slice for them outside the jit lowering's islands."""
  out = collections.Counter()
  for c in collectives:
    kind = "all-reduce" if c.kind == "reduce-scatter" else c.kind
    if program is not None:
      out[(kind, program.ops[c.op].name)] += c.bytes
    elif not c.from_constant:
      out[(kind, c.source)] += c.bytes
  return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model_name", ["mlp:small", "gpt:small"])
def test_strategy(model_name, strategy):
  workload, program, expected = model(model_name)
  mesh_text, schedule = STRATEGIES[strategy]
  pp = P.apply(program, mesh_text, schedule)
  assert not pp.fallbacks
  mesh = pp.mesh.to_jax()
  args = workload.args

  spmd = jax.jit(pp.lower_spmd(mesh)).lower(*args).compile()
  jitted = pp.jit(mesh).lower(*args).compile()

  # 1. Both lowerings compute the unpartitioned program.
  for name, compiled in (("shard_map", spmd), ("jit", jitted)):
    actual = jax.tree_util.tree_leaves(compiled(*args))
    for e, a, out_name in zip(expected, actual, program.output_names):
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-4,
                                 err_msg=f"{name}: {out_name} under {schedule}")

  # 2. The shard_map program holds exactly the planned collectives.
  planned = collections.Counter()
  for c in pp.collectives:
    planned[(c.kind, c.axes)] += c.bytes
  compiled = collections.Counter()
  for c in hlo_collectives(spmd.as_text(), pp.mesh):
    compiled[(c.kind, c.axes)] += c.bytes
  assert compiled == planned

  # 3. XLA's own partitioning of the jit program, side by side with the plan.
  xla = hlo_collectives(jitted.as_text(), pp.mesh)
  # XLA:CPU forms no reduce-scatter of its own; the only ones come from the plan's islands.
  assert all(c.source == "reduce_scatter" for c in xla if c.kind == "reduce-scatter"), \
      {c.source for c in xla if c.kind == "reduce-scatter"}
  # Only ZeRO-3 gathers for the backward; the jit lowering makes XLA gather again too.
  assert bool(regathered(pp)) == strategy.startswith("zero3")
  ours = by_source(pp.collectives, program)
  theirs = by_source(xla)
  explained = EXPLAINED.get((model_name, strategy), [])
  for kind, source, _ in explained:
    assert ours[(kind, source)] != theirs[(kind, source)], f"no longer differs: {kind} {source}"
  table = []
  for kind in sorted({k for k, _ in ours} | {k for k, _ in theirs}):
    mine = sum(b for (k, s), b in ours.items() if k == kind)
    xlas = sum(b for (k, s), b in theirs.items() if k == kind)
    mine_rest = sum(b for (k, s), b in ours.items()
                    if k == kind and (k, s) not in {(e[0], e[1]) for e in explained})
    xla_rest = sum(b for (k, s), b in theirs.items()
                   if k == kind and (k, s) not in {(e[0], e[1]) for e in explained})
    table.append(f"{kind:20s} plan {mine:9d}  xla {xlas:9d}")
    assert abs(xla_rest - mine_rest) <= 0.1 * max(mine_rest, 1), "\n".join(table)

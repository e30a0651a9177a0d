"""Random schedules against the partitioner's promise: a partitioned program computes what the
original computes, whatever the schedule.

A case is a corpus family at a tiny size, a mesh (1-D or 2-D, 8 CPU devices) and a schedule
drawn either from the environment's action masks (legal actions until it finishes) or as a
random list of manual tactics (tiles of random inputs along random dimensions included). Each
partitioned program runs under both lowerings and is compared with the unpartitioned one
(`partitioner.verify`, tolerance scaled to the dtype, random inputs). A schedule the
partitioner refuses (a dimension that does not divide, an axis used twice) is counted as
refused, not as a failure; a wrong result is a failure.

  python benchmarks/fuzz_partitioner.py --examples 2000 --out benchmarks/results/fuzz.json

Hypothesis draws the cases (`tests/partitioner/test_random_schedules.py` runs a bounded number
in `make test`), so a failure shrinks to a minimal schedule; the report lists the schedules
tried, the primitives covered by a sharded case, and the failures.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAMILIES = ("mlp", "gpt", "bert", "vit", "resnet", "gnn", "t5", "moe", "unet", "ssm",
            "hf_gpt2", "hf_bert", "hf_t5", "hf_vit")
MESHES = ("batch=8", "model=8", "batch=4,model=2", "batch=2,model=4")
TACTICS = ("BatchParallel", "Megatron", "ZeRO", "EmbeddingSharding", "ExpertParallel",
           "SequenceParallel", "Tile", "Replicate")
MAX_ENV_STEPS = 6


@functools.lru_cache(maxsize=None)
def model(family: str):
  """(workload, program) of a family at its tiny preset. Float inputs that are all zeros (a
  fresh optimizer's moments) are filled at random: at zero, Adam's first step is g / (|g| +
  eps), which turns a rounding difference in a gradient that is exactly zero in theory (a key
  bias under softmax) into a difference the size of the learning rate."""
  import corpus
  import jax
  import partitioner as P
  workload = corpus.load(f"{family}:small", abstract=False)
  rng = np.random.default_rng(0)

  def fill(x):
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and \
        x.size and not bool(jax.numpy.any(x)):
      return jax.numpy.asarray(rng.uniform(0.01, 0.1, x.shape), x.dtype)
    return x

  workload = workload._replace(args=jax.tree_util.tree_map(fill, workload.args))
  return workload, P.trace(workload.fn, *workload.args)


@functools.lru_cache(maxsize=None)
def expected(family: str) -> list:
  """The unpartitioned program's outputs on `verify`'s inputs: the same for every schedule."""
  import jax
  from partitioner.verify import example_inputs
  workload, program = model(family)
  program = program.root   # the user's program, before layouts (partitioner/layouts.py)
  concrete = jax.tree_util.tree_unflatten(program.in_tree, example_inputs(workload.args))
  return [np.asarray(x) for x in jax.jit(program.evaluate)(*program.flatten_args(concrete))]


@functools.lru_cache(maxsize=None)
def environment_context(family: str, mesh: str):
  from environments.partitioning_env import task_context
  from environments.tasks import Task
  return task_context(Task(f"{family}:small", mesh))


@st.composite
def cases(draw, families=FAMILIES, meshes=MESHES):
  """(family, mesh, schedule text, how it was drawn)."""
  family = draw(st.sampled_from(families))
  mesh = draw(st.sampled_from(meshes))
  sizes = {a.split("=")[0]: int(a.split("=")[1]) for a in mesh.split(",")}
  axes = list(sizes)
  if draw(st.booleans()):
    from environments.partitioning_env import PartitioningEnv
    env = PartitioningEnv(environment_context(family, mesh))
    env.reset()
    actions = env.context.actions
    chosen = []
    for _ in range(draw(st.integers(1, MAX_ENV_STEPS))):
      legal = [int(i) for i in env.legal_actions()]
      if len(legal) <= 1:
        break
      i = draw(st.sampled_from(legal))
      if i == env.finish_action:
        break
      env.step(i)
      chosen.append(str(actions[i].tactic))
    return family, mesh, "; ".join(chosen), "environment"
  _, program = model(family)
  tactics = []
  for _ in range(draw(st.integers(1, 4))):
    kind = draw(st.sampled_from(TACTICS))
    axis = draw(st.sampled_from(axes))
    if kind == "ZeRO":
      tactics.append(f"ZeRO({axis}, stage={draw(st.integers(1, 3))})")
    elif kind in ("Tile", "Replicate"):
      name = draw(st.sampled_from(program.input_names))
      shape = program.value(name).shape
      dims = [d for d, n in enumerate(shape) if n % sizes[axis] == 0]
      if kind == "Replicate" or not dims:
        tactics.append(f"Replicate({name}, {axis})")
      else:   # a dimension the axis divides: most of these partition
        tactics.append(f"Tile({name}, {draw(st.sampled_from(dims))}, {axis})")
    else:
      tactics.append(f"{kind}({axis})")
  return family, mesh, "; ".join(tactics), "manual"


def check(family: str, mesh: str, schedule: str) -> dict:
  """Partitions and verifies one case: {"outcome": "ok" | "refused" | "wrong", ...}."""
  import partitioner as P
  from partitioner.errors import ShardzeroError
  from partitioner.verify import verify
  workload, program = model(family)
  try:
    pp = P.apply(program, mesh, schedule)
  except ShardzeroError as e:
    return {"outcome": "refused", "reason": str(e).splitlines()[0][:200]}
  sharded = sorted({program.ops[i].name for i, p in enumerate(pp.plan.ops)
                    if any(p.fac_axes)})
  try:
    result = verify(pp, workload.args, expected=expected(family))
  except Exception as e:   # a lowering that fails is as wrong as one that computes wrongly
    return {"outcome": "wrong", "sharded": sharded, "errors": {},
            "worst": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  return {"outcome": "ok" if result.ok else "wrong", "sharded": sharded,
          "errors": result.errors, "worst": result.worst}


def corpus_primitives() -> set[str]:
  return {op.name for f in FAMILIES for op in model(f)[1].ops}


def run(examples: int, seed: int, out: Path | None) -> dict:
  from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
  from launch.progress import Ticker
  stats = {"tried": 0, "ok": 0, "refused": 0, "wrong": 0, "by_source": collections.Counter(),
           "by_family": collections.Counter(), "covered": collections.Counter(),
           "failures": [], "refusals": collections.Counter()}
  ticker = Ticker("schedules", examples)

  @hypothesis_seed(seed)
  @settings(max_examples=examples, deadline=None, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck))
  @given(cases())
  def one(case):
    family, mesh, schedule, source = case
    r = check(family, mesh, schedule)
    stats["tried"] += 1
    stats[r["outcome"]] += 1
    stats["by_source"][source] += 1
    stats["by_family"][family] += 1
    for name in r.get("sharded", ()):
      stats["covered"][name] += 1
    if r["outcome"] == "refused":
      stats["refusals"][r["reason"].split(":")[0][:60]] += 1
    if r["outcome"] == "wrong":
      stats["failures"].append({"family": family, "mesh": mesh, "schedule": schedule,
                                "errors": r["errors"], "worst": r["worst"]})
    ticker.update(stats["tried"], f"{stats['wrong']} wrong, {stats['refused']} refused")
    if out is not None and stats["tried"] % 25 == 0:   # a stopped run keeps what it found
      write(start, final=False)

  primitives = corpus_primitives()

  def write(start, final=True) -> dict:
    report = {"examples": examples, "seed": seed, "finished": final,
              "seconds": time.time() - start, "tried": stats["tried"], "ok": stats["ok"],
              "refused": stats["refused"], "wrong": stats["wrong"],
              "by_source": dict(stats["by_source"]), "by_family": dict(stats["by_family"]),
              "covered": dict(sorted(stats["covered"].items())),
              "not_covered": sorted(primitives - set(stats["covered"])),
              "refusals": dict(stats["refusals"].most_common(10)),
              "failures": stats["failures"]}
    if out is not None:
      out.parent.mkdir(parents=True, exist_ok=True)
      out.write_text(json.dumps(report, indent=1) + "\n")
    return report

  start = time.time()
  with ticker:
    one()
  return write(start)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--examples", type=int, default=200, help="random schedules to try")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz.json"))
  parser.add_argument("--optimize", action="store_true",
                      help="compile with LLVM's optimizations (about twice as slow)")
  args = parser.parse_args(argv)
  # Before JAX starts. LLVM's optimization of the CPU code is left out unless --optimize: what
  # is checked is the partitioner's rewriting and XLA's SPMD partitioning, which run either
  # way, and compiling takes half the time.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
      + " --xla_force_host_platform_device_count=8"
      + ("" if args.optimize else " --xla_backend_optimization_level=0"))
  r = run(args.examples, args.seed, args.out)
  print(f"{r['tried']} schedules in {r['seconds']:.0f} s: {r['ok']} verified, "
        f"{r['refused']} refused, {r['wrong']} wrong "
        f"(from action masks {r['by_source'].get('environment', 0)}, "
        f"manual {r['by_source'].get('manual', 0)})")
  print(f"primitives with a sharded case: {len(r['covered'])}; without: "
        f"{', '.join(r['not_covered']) or 'none'}")
  for f in r["failures"]:
    print(f"WRONG {f['family']} on {f['mesh']}: {f['schedule']} ({f['errors']})")
  print(f"wrote {args.out}")
  return 1 if r["wrong"] else 0


if __name__ == "__main__":
  sys.exit(main())

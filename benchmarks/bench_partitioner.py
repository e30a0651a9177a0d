"""Partitioner speed on GPT training steps of 12, 24 and 48 layers.

For each: ops in the IR, trace time, time to apply BatchParallel + Megatron + ZeRO-3 (tactics
and propagation) and the part of it spent propagating (also per 100 ops), time to derive the
SPMD plan, and lowering time (building the shard_map
program and tracing it to StableHLO with jax.jit(...).lower). Goal: propagation grows linearly
and stays under 1 ms per 100 ops. Prints a table and writes benchmarks/results/partitioner.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

MESH = "batch=8,model=4"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=32")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import corpus  # noqa: E402
import partitioner as P  # noqa: E402
from benchmarks.reporting import print_table, write_results  # noqa: E402

SCHEDULE = "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=3)"


def best_of(fn, repeat):
  times, result = [], None
  for _ in range(repeat):
    t = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - t)
  return min(times), result


def measure(layers: int, repeat: int) -> dict:
  spec = f"gpt:layers={layers},d_model=1024,heads=16,vocab=32768,seq=512,batch=32"
  workload = corpus.load(spec, abstract=True)
  first = time.perf_counter()
  program = P.trace(workload.fn, *workload.args)
  cold = time.perf_counter() - first
  # A fresh function object each time, so that JAX's trace cache does not answer for us.
  fn = workload.fn
  trace_s, program = best_of(lambda: P.trace(lambda *a: fn(*a), *workload.args,
                                             arg_names=program.arg_names), repeat)
  apply_s, pp = best_of(lambda: P.apply(program, MESH, SCHEDULE), repeat)
  visits = sum(r.visits for r in pp.reports)
  propagate_s = min(sum(r.propagate_s for r in P.apply(program, MESH, SCHEDULE).reports)
                    for _ in range(repeat))

  def plan():
    fresh = P.apply(program, MESH, SCHEDULE)
    t = time.perf_counter()
    fresh.plan
    return time.perf_counter() - t

  plan_s = min(plan() for _ in range(repeat))
  mesh = pp.mesh.to_jax()
  lower_s, _ = best_of(lambda: jax.jit(pp.lower_spmd(mesh)).lower(*workload.args), 1)
  return {
      "layers": layers, "ops": program.num_ops, "trace_cold_s": cold, "trace_s": trace_s,
      "apply_s": apply_s, "op_visits": visits, "plan_s": plan_s, "lower_s": lower_s,
      "apply_ms_per_100_ops": 100e3 * apply_s / program.num_ops, "propagate_s": propagate_s,
      "propagate_ms_per_100_ops": 100e3 * propagate_s / program.num_ops,
      "collectives": len(pp.collectives), "conflicts": len(pp.conflicts),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", default="12,24,48", help="comma-separated layer counts")
  parser.add_argument("--repeat", type=int, default=3, help="best of N timings")
  parser.add_argument("--out", default="benchmarks/results/partitioner.json")
  args = parser.parse_args(argv)
  rows = [measure(int(n), args.repeat) for n in args.layers.split(",")]
  header = ("layers", "ops", "trace ms", "apply ms", "propagate", "ms/100 ops", "visits",
            "plan ms", "lower ms")
  print(f"GPT training step, mesh {MESH}, schedule: {SCHEDULE}")
  print_table(header, [(
      r["layers"], r["ops"], f"{1e3 * r['trace_s']:.0f}", f"{1e3 * r['apply_s']:.0f}",
      f"{1e3 * r['propagate_s']:.0f}", f"{r['propagate_ms_per_100_ops']:.2f}",
      r["op_visits"], f"{1e3 * r['plan_s']:.0f}", f"{1e3 * r['lower_s']:.0f}") for r in rows],
      10, sep="  ")
  print(f"(first trace of the first model, JAX caches cold: {rows[0]['trace_cold_s']:.2f} s)")
  write_results(args.out, "partitioner", rows, mesh=MESH, schedule=SCHEDULE, jax=jax.__version__)
  return 0


if __name__ == "__main__":
  sys.exit(main())

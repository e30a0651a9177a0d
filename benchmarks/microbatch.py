"""`Microbatch(k)` across the corpus: which families it cuts, and whether the cut step is exact.

Per corpus family at its `small` preset, on batch=2,model=4 (8 CPU devices):
`Microbatch(2); BatchParallel(batch); BatchParallel(model)`, both lowerings verified against
the whole-batch step (or the one-line reason it is refused), and the predicted peak memory per
device (h100) with and without micro-batches. Prints a table and writes
benchmarks/results/microbatch.json.

With --published: Megatron-LM's 18.4B (Table 1: t=8, d=32, batch 1024; `published.py`'s
step, 40 scanned layers) with 1, 4, 8 and 32 micro-batches on a100-80gb: predicted TFLOP/s per
GPU, peak memory, and where the data-parallel all-reduces run.

  python benchmarks/microbatch.py            # about 3 minutes on 2 cores
  python benchmarks/microbatch.py --published   # about 10 seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402
import partitioner as P  # noqa: E402
from partitioner.cost import simulate  # noqa: E402
from partitioner.verify import verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MESH = "batch=2,model=4"
DATA = "BatchParallel(batch); BatchParallel(model)"


def row(family: str, k: int) -> dict:
  workload = corpus.load(f"{family}:small")
  program = P.trace(workload.fn, *workload.args)
  out = {"family": family, "k": k}
  whole = P.apply(program, MESH, DATA)
  out["whole_peak_bytes"] = simulate(whole, "h100").peak_memory_bytes
  start = time.perf_counter()
  try:
    pp = P.apply(program, MESH, f"Microbatch({k}); {DATA}")
  except P.ShardzeroError as e:
    return {**out, "status": "refused", "why": str(e)}
  out["rewrite_s"] = time.perf_counter() - start
  out["peak_bytes"] = simulate(pp, "h100").peak_memory_bytes
  result = verify(pp, workload.args)
  return {**out, "status": "verified" if result.ok else "MISMATCH",
          "max_abs_err": result.max_abs_err}


def published_rows(ks=(1, 4, 8, 32)) -> list[dict]:
  import published
  run = next(r for r in published.RUNS if r.params == "18.4B")
  program = published.traced(run.layers, run.hidden, run.heads, run.batch)
  mesh, tactics = published.schedule(run)
  rows = []
  for k in ks:
    pp = P.apply(program, mesh, (f"Microbatch({k}); " if k > 1 else "") + tactics)
    cost = simulate(pp, "a100-80gb")
    repeat = pp.program.op_repeat
    data = [c for c in pp.collectives if c.axes == ("data",)]
    rows.append({"k": k, "tflops": published.model_flops(run) / (cost.step_time_s * run.gpus)
                 / 1e12, "published_tflops": run.published,
                 "peak_gib": cost.peak_memory_bytes / 2**30,
                 "exposed_comm_s": cost.exposed_comm_s,
                 "data_all_reduces_per_step": int(sum(repeat[c.op] for c in data))})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", default=",".join(corpus.FAMILIES),
                      help="comma-separated corpus families; default: all")
  parser.add_argument("--k", type=int, default=2, help="micro-batches; default 2")
  parser.add_argument("--json", default=str(ROOT / "benchmarks/results/microbatch.json"))
  parser.add_argument("--published", action="store_true",
                      help="Megatron-LM's 18.4B with micro-batches instead of the corpus")
  args = parser.parse_args(argv)
  if args.published:
    print(f"{'k':>3s} {'TFLOP/s':>8s} {'published':>9s} {'peak GiB':>8s} {'exposed s':>9s} "
          f"{'dp all-reduces':>14s}")
    for r in published_rows():
      print(f"{r['k']:3d} {r['tflops']:8.0f} {r['published_tflops']:9.0f} {r['peak_gib']:8.1f} "
            f"{r['exposed_comm_s']:9.2f} {r['data_all_reduces_per_step']:14d}")
    return 0
  rows = []
  families = args.families.split(",")
  for i, family in enumerate(families):
    print(f"[{i + 1}/{len(families)}] {family}", file=sys.stderr, flush=True)
    rows.append(row(family, args.k))
  print(f"{'family':14s} {'status':10s} {'error':>9s} {'peak whole':>11s} {'peak cut':>9s}  why")
  for r in rows:
    err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
    cut = f"{r['peak_bytes'] / 2**20:.1f}M" if "peak_bytes" in r else ""
    print(f"{r['family']:14s} {r['status']:10s} {err:>9s} {r['whole_peak_bytes'] / 2**20:10.1f}M "
          f"{cut:>9s}  {r.get('why', '')}")
  Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  Path(args.json).write_text(json.dumps({"mesh": MESH, "schedule": DATA, "rows": rows},
                                        indent=1))
  return 0 if all(r["status"] != "MISMATCH" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

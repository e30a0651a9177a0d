"""Fused projections held interleaved and vocabularies padded (partitioner/layouts.py).

Default: HF models at published sizes on 32 H100s (`batch=8,model=4`), at their preset's
global batch and at 256: the predicted step and peak memory per device of data parallelism,
dp+Megatron and dp+Megatron with vocabulary-parallel embeddings, traced with the layouts and
without them (`trace(..., layouts=False)`, the user's layout). Simulated only: seconds.

--verify: every HF family at its `small` preset with an odd vocabulary (`vocab=1090`, padded
to 1,152), on batch=2,model=4 (8 CPU devices), under dp+Megatron+vocabulary: both lowerings
against the user's program, and what was held in layout. A few minutes on 2 cores.

Prints a table and writes benchmarks/results/layouts.json (or layouts_verify.json).

  python benchmarks/layouts.py
  python benchmarks/layouts.py --verify
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import corpus  # noqa: E402
import partitioner as P  # noqa: E402
from partitioner.cost import simulate  # noqa: E402
from partitioner.verify import verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MESH = "batch=8,model=4"
STRATEGIES = {
    "dp": "BatchParallel(batch); BatchParallel(model)",
    "dp+megatron": "BatchParallel(batch); Megatron(model)",
    "dp+megatron+vocab": "BatchParallel(batch); Megatron(model); EmbeddingSharding(model)",
}
MODELS = ("hf_gpt2:124m", "hf_gptneo:125m", "hf_bert:base", "hf_roberta:base")
FAMILIES = ("hf_gpt2", "hf_bert", "hf_t5", "hf_llama", "hf_mistral", "hf_opt", "hf_gptneo",
            "hf_bart", "hf_roberta", "hf_bloom", "hf_gemma")


def sized_rows(models=MODELS, batches=(None, 256)) -> list[dict]:
  rows = []
  for model in models:
    for batch in batches:
      spec = model if batch is None else f"{model},batch={batch}"
      workload = corpus.load(spec)
      for held in (False, True):
        program = P.trace(workload.fn, *workload.args, layouts=held)
        for name, schedule in STRATEGIES.items():
          cost = simulate(P.apply(program, MESH, schedule), "h100")
          rows.append({"model": spec, "layouts": held, "strategy": name,
                       "step_ms": cost.step_time_s * 1e3,
                       "peak_gib": cost.peak_memory_bytes / 2**30, "fits": bool(cost.fits)})
      print(f"  {spec}", file=sys.stderr, flush=True)
  return rows


def verify_row(family: str) -> dict:
  spec = f"{family}:small,vocab=1090"
  workload = corpus.load(spec)
  program = P.trace(workload.fn, *workload.args)
  held = sorted({str(lay).split()[2] for lay in program.layouts.values()})
  pp = P.apply(program, "batch=2,model=4", STRATEGIES["dp+megatron+vocab"])
  result = verify(pp, workload.args)
  gathers = sum(c.bytes for c in pp.collectives if c.kind == "all-gather" and "model" in c.axes)
  return {"model": spec, "held": held, "inputs_held": len(program.layouts),
          "verified": bool(result.ok), "max_abs_err": result.max_abs_err,
          "model_all_gather_bytes": gathers}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--verify", action="store_true",
                      help="verify every HF family with an odd vocabulary instead")
  parser.add_argument("--json", help="where to write the rows (default: "
                      "benchmarks/results/layouts.json or layouts_verify.json)")
  args = parser.parse_args(argv)
  out = Path(args.json or ROOT / "benchmarks/results" /
             ("layouts_verify.json" if args.verify else "layouts.json"))
  if args.verify:
    rows = []
    for i, family in enumerate(FAMILIES):
      print(f"[{i + 1}/{len(FAMILIES)}] {family}", file=sys.stderr, flush=True)
      rows.append(verify_row(family))
    print(f"{'model':28s} {'held':22s} {'inputs':>6s} {'verified':>8s} {'error':>8s} "
          f"{'gathered over model':>19s}")
    for r in rows:
      print(f"{r['model']:28s} {'+'.join(r['held']) or '-':22s} {r['inputs_held']:6d} "
            f"{'yes' if r['verified'] else 'NO':>8s} {r['max_abs_err']:8.1e} "
            f"{r['model_all_gather_bytes'] / 2**20:17.1f}Mi")
    ok = all(r["verified"] for r in rows)
  else:
    rows = sized_rows()
    print(f"{'model':26s} {'strategy':18s} {'user layout':>14s} {'held':>14s}   (ms, GiB; h100, "
          f"{MESH})")
    by = {(r["model"], r["strategy"], r["layouts"]): r for r in rows}
    for (model, strategy, held), r in by.items():
      if held:
        u = by[(model, strategy, False)]
        print(f"{model:26s} {strategy:18s} {u['step_ms']:7.1f} {u['peak_gib']:5.1f}G "
              f"{r['step_ms']:7.1f} {r['peak_gib']:5.1f}G")
    ok = True
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"mesh": MESH, "rows": rows}, indent=1))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

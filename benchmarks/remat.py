"""`Remat()` across the corpus, and on the 7B regime where nothing fits without it.

Per corpus family at its `small` preset, on batch=2,model=4 (8 CPU devices):
`Remat(); BatchParallel(batch); BatchParallel(model)`, both lowerings verified against the
user's step (or the one-line reason it is refused); the predicted peak per device (h100) and
XLA:CPU's footprint of the donated jit program, with and without `Remat()`, at a batch where
activations count (batch=32 for the sequence models); and the matmuls XLA compiled.

With --llama: HF Flax Llama 7B at batch 256 (one 4,096-token sequence a device) on
`data=4,fsdp=8,tensor=8` H100s, HSDP and its forms with and without `Remat()` and
`Microbatch(k)`: predicted step time and peak per device.

Prints a table and writes benchmarks/results/remat.json (remat_llama.json with --llama).

  python benchmarks/remat.py            # about 18 minutes on 2 cores
  python benchmarks/remat.py --llama    # about a minute
"""

from __future__ import annotations

import argparse
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
from partitioner.hlo import memory_footprint  # noqa: E402
from partitioner.verify import verify  # noqa: E402
from reporting import print_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MESH = "batch=2,model=4"
DATA = "BatchParallel(batch); BatchParallel(model)"
# Where activations count at a size XLA:CPU compiles in seconds.
MEMORY_SIZE = {"gpt": "batch=32,seq=64", "bert": "batch=32,seq=64", "vit": "batch=64,image=32",
               "t5": "batch=32,src_seq=64,tgt_seq=32", "hf_gpt2": "batch=32,seq=128",
               "hf_bert": "batch=32,seq=128", "hf_llama": "batch=32,seq=128"}
LLAMA = ("hf_llama:7b,batch=256", "data=4,fsdp=8,tensor=8", "h100")
HSDP = "BatchParallel(data); BatchParallel(fsdp); BatchParallel(tensor); ZeRO(tensor)"
LLAMA_PLANS = (HSDP, f"Remat(); {HSDP}", f"Microbatch(4); {HSDP}",
               f"Remat(); Microbatch(2); {HSDP}",
               "Remat(); BatchParallel(data); BatchParallel(fsdp); BatchParallel(tensor); "
               "ZeRO(fsdp); ZeRO(tensor)")


def _footprint_and_dots(pp, args) -> tuple[int, int]:
  compiled = pp.jit(pp.mesh.to_jax(), donate=True).lower(*args).compile()
  return memory_footprint(compiled.memory_analysis()), compiled.as_text().count(" dot(")


def row(family: str) -> dict:
  workload = corpus.load(f"{family}:small")
  program = P.trace(workload.fn, *workload.args)
  out = {"family": family}
  start = time.perf_counter()
  try:
    pp = P.apply(program, MESH, f"Remat(); {DATA}")
  except P.ShardzeroError as e:
    return {**out, "status": "refused", "why": str(e)}
  out["rewrite_s"] = time.perf_counter() - start
  result = verify(pp, workload.args)
  out.update(status="verified" if result.ok else "MISMATCH", max_abs_err=result.max_abs_err)
  size = MEMORY_SIZE.get(family)
  mem = corpus.load(f"{family}:{size}") if size else workload
  mem_program = P.trace(mem.fn, *mem.args) if size else program
  for name, schedule in (("whole", DATA), ("remat", f"Remat(); {DATA}")):
    try:
      pp = P.apply(mem_program, MESH, schedule)
    except P.ShardzeroError as e:
      return {**out, "status": "refused", "why": f"at {size}: {e}"}
    out[f"{name}_peak_bytes"] = simulate(pp, "h100").peak_memory_bytes
    out[f"{name}_xla_bytes"], out[f"{name}_dots"] = _footprint_and_dots(pp, mem.args)
  out["memory_model"] = f"{family}:{size or 'small'}"
  return out


def llama_rows() -> list[dict]:
  from environments.tasks import load_program
  model, mesh, hardware = LLAMA
  program = load_program(model)
  rows = []
  for schedule in LLAMA_PLANS:
    start = time.perf_counter()
    cost = simulate(P.apply(program, mesh, schedule), hardware)
    rows.append({"model": model, "mesh": mesh, "hardware": hardware, "schedule": schedule,
                 "step_time_s": cost.step_time_s, "peak_bytes": cost.peak_memory_bytes,
                 "seconds": time.perf_counter() - start})
    print(f"{schedule}: {cost.step_time_s:.3f} s, {cost.peak_memory_bytes / 2**30:.1f} GiB",
          file=sys.stderr, flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", default=",".join(corpus.FAMILIES),
                      help="comma-separated corpus families; default: all")
  parser.add_argument("--llama", action="store_true",
                      help="HF Llama 7B at one sequence a device instead of the corpus")
  parser.add_argument("--json", default=None, help="default: benchmarks/results/remat.json "
                      "(remat_llama.json with --llama)")
  args = parser.parse_args(argv)
  gib, mib = (lambda b: f"{b / 2**30:.1f}"), (lambda b: f"{b / 2**20:.1f}")
  if args.llama:
    rows = llama_rows()
    print_table(["step s", "peak GiB"],
                [(f"{r['step_time_s']:.3f}", gib(r["peak_bytes"])) for r in rows], width=9,
                trail=["  plan"] + [f"  {r['schedule']}" for r in rows])
    write_results(args.json or str(ROOT / "benchmarks/results/remat_llama.json"), "remat",
                  rows)
    return 0
  rows = []
  families = args.families.split(",")
  for i, family in enumerate(families):
    print(f"[{i + 1}/{len(families)}] {family}", file=sys.stderr, flush=True)
    rows.append(row(family))
  table, trail = [], ["  memory at / why refused"]
  for r in rows:
    if r["status"] == "refused":
      table.append((r["family"], "refused", "", "", "", ""))
      trail.append(f"  {r['why']}")
      continue
    table.append((r["family"], r["status"], f"{r['max_abs_err']:.1e}",
                  f"{mib(r['whole_peak_bytes'])}->{mib(r['remat_peak_bytes'])}",
                  f"{mib(r['whole_xla_bytes'])}->{mib(r['remat_xla_bytes'])}",
                  f"{r['whole_dots']}->{r['remat_dots']}"))
    trail.append(f"  {r['memory_model']}")
  print_table(["family", "status", "error", "peak MiB", "XLA MiB", "dots"], table, width=13,
              trail=trail)
  write_results(args.json or str(ROOT / "benchmarks/results/remat.json"), "remat", rows,
                mesh=MESH, schedule=f"Remat(); {DATA}")
  return 0 if all(r["status"] != "MISMATCH" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

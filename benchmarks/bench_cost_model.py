"""Cost-model speed on GPT training steps of 12, 24 and 48 layers, as a search uses it.

An episode starts from the unpartitioned program and adds one tactic per step
(BatchParallel, then Megatron, then ZeRO-3). For each step: time to apply the tactic
(propagation), to update the SPMD plan and to re-simulate, each from its parent's results
(incremental), best of the episodes after the first; the first episode's total, where the
propagation and plan memo (outcomes shared by ops alike) is still empty. Also: a simulation from scratch of the final program (plan given), the one-off
per-program set-up, and the same on a 4096-device mesh. Goal: simulating the 48-layer step
well under 50 ms. Prints a table and writes benchmarks/results/cost_model.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import corpus  # noqa: E402
import partitioner as P  # noqa: E402
from partitioner.cost import Simulator  # noqa: E402
from benchmarks.reporting import print_table, write_results  # noqa: E402

TACTICS = ["BatchParallel(batch)", "Megatron(model)", "ZeRO(batch, stage=3)"]
HARDWARE = "h100"


def timed(fn):
  t = time.perf_counter()
  out = fn()
  return time.perf_counter() - t, out


def measure(layers: int, mesh: str, batch: int, repeat: int) -> dict:
  spec = f"gpt:layers={layers},d_model=1024,heads=16,vocab=32768,seq=512,batch={batch}"
  workload = corpus.load(spec, abstract=True)
  program = P.trace(workload.fn, *workload.args)
  root = P.apply(program, mesh)
  setup_s, sim = timed(lambda: Simulator(program, root.mesh, HARDWARE))
  episodes = []
  for _ in range(repeat + 1):   # the first episode fills the propagation memo; the rest reuse it
    root = P.apply(program, mesh)
    sim(root)
    pps, steps = [root], []
    for tactic in TACTICS:
      apply_s, pp = timed(lambda: pps[-1].apply(tactic))
      plan_s, _ = timed(lambda: pp.plan)
      simulate_s, report = timed(lambda: sim(pp))
      pps.append(pp)
      steps.append({"tactic": tactic, "changed_values": len(pp.state.changed),
                    "apply_s": apply_s, "plan_s": plan_s, "simulate_s": simulate_s})
    fresh = P.apply(program, mesh, "; ".join(TACTICS))
    fresh.plan
    full_s, _ = timed(lambda: sim(fresh))
    episodes.append((steps, full_s))
  cold = sum(s["apply_s"] + s["plan_s"] + s["simulate_s"] for s in episodes[0][0])
  warm = episodes[1:] or episodes
  steps = [{**ss[0], **{k: min(s[k] for s in ss) for k in ("apply_s", "plan_s", "simulate_s")}}
           for ss in zip(*(e[0] for e in warm))]
  best = {"steps": steps, "simulate_full_s": min(e[1] for e in warm), "cold_episode_s": cold,
          "report": report}
  report = best.pop("report")
  return {"layers": layers, "mesh": mesh, "devices": root.mesh.device_count, "ops": program.num_ops,
          "setup_s": setup_s, **best, "step_time_s": report.step_time_s,
          "peak_memory_bytes": report.peak_memory_bytes}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", default="12,24,48", help="comma-separated layer counts")
  parser.add_argument("--repeat", type=int, default=3,
                      help="best of N episodes after the first (which fills the memo)")
  parser.add_argument("--out", default="benchmarks/results/cost_model.json")
  args = parser.parse_args(argv)
  cases = [(int(n), "batch=8,model=4", 32) for n in args.layers.split(",")]
  cases.append((cases[-1][0], "batch=512,model=8", 512))
  rows = [measure(n, mesh, batch, args.repeat) for n, mesh, batch in cases]
  print(f"GPT training step on {HARDWARE}; one tactic per step: {'; '.join(TACTICS)}")
  print("incremental per step (apply / plan / simulate ms, best episode); the first episode's "
        "total (empty memo); simulate from scratch; set-up")
  header = ("layers", "devices", "ops", *(t.split("(")[0] for t in TACTICS), "first episode",
            "full sim", "set-up")
  table = []
  for r in rows:
    cells = [r["layers"], r["devices"], r["ops"]]
    cells += [f"{1e3 * s['apply_s']:.0f} / {1e3 * s['plan_s']:.0f} / "
              f"{1e3 * s['simulate_s']:.1f}" for s in r["steps"]]
    cells += [f"{1e3 * r['cold_episode_s']:.0f} ms", f"{1e3 * r['simulate_full_s']:.1f} ms",
              f"{r['setup_s']:.2f} s"]
    table.append(cells)
  print_table(header, table, 22)
  write_results(args.out, "cost_model", rows, hardware=HARDWARE, tactics=TACTICS)
  return 0


if __name__ == "__main__":
  sys.exit(main())

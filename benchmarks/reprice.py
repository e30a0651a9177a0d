"""Stored plans under a changed cost model: which task's best plan, and which agent's standing,
moves when one hardware field changes.

Re-running every agent of a suite after a cost-model change takes hours on 2 cores; the plans
they chose are in the store. This prices each distinct plan of each task twice, under the
hardware as the catalog has it and under the same hardware with `--before FIELD=VALUE`, and
reports, per task, the fastest plan that fits under each, and per agent, its ratio to that
best under each. An agent that would now choose differently is not re-run: where the best
plan of a task changes, the agents that chose the old best are the ones to re-run.

  python benchmarks/reprice.py --store docs/scales/results.jsonl --min-devices 1024 \\
      --before collectives=alpha-beta
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

import partitioner as P  # noqa: E402
from environments.tasks import Task, folded_program, load_program  # noqa: E402
from partitioner.cost import Simulator, load_hardware, simulate  # noqa: E402
from partitioner.errors import ShardzeroError  # noqa: E402
from partitioner.mesh import Mesh  # noqa: E402
from partitioner.tactics import ProgramRewrite, parse_schedule  # noqa: E402


def latest_rows(path: str, min_devices: int) -> list[dict]:
  """The newest row of each (task, agent) at `min_devices` or more."""
  rows: dict = {}
  for line in Path(path).read_text().splitlines():
    r = json.loads(line)
    if r["devices"] >= min_devices and r.get("schedule") is not None:
      rows[(r["task"], r["agent"])] = r
  return list(rows.values())


def variant(hardware: str, assignment: str):
  field, _, value = assignment.partition("=")
  hw = load_hardware(hardware)
  if field not in {f.name for f in dataclasses.fields(hw)}:
    raise SystemExit(f"reprice: unknown hardware field {field!r}")
  current = getattr(hw, field)
  value = type(current)(value) if not isinstance(current, str) else value
  return dataclasses.replace(hw, name=f"{hw.name} ({assignment})", **{field: value})


def price(rows: list[dict], before: str) -> dict:
  """(task, schedule) -> {"before": (step, fits), "after": (step, fits)}."""
  by_task = defaultdict(set)
  first = {}
  for r in rows:
    by_task[r["task"]].add(r["schedule"])
    first.setdefault(r["task"], r)
  out = {}
  for task_name, schedules in tqdm(sorted(by_task.items()), desc="tasks", mininterval=5):
    r = first[task_name]
    budget = r.get("budget_bytes")
    task = Task(r["model"], r["mesh"], r["hardware"], budget)
    folding = folded_program(task)
    program = folding.program if folding is not None else load_program(r["model"])
    mesh = Mesh.parse(r["mesh"])
    hardware = {"after": load_hardware(r["hardware"]), "before": variant(r["hardware"], before)}
    sims = {k: Simulator(program, mesh, hw, folding=folding) for k, hw in hardware.items()}
    for schedule in schedules:
      try:   # a plan that cuts or recomputes rewrites the whole step: priced unfolded
        rewrites = any(isinstance(t, ProgramRewrite) for t in parse_schedule(schedule))
        pp = P.apply(load_program(r["model"]) if rewrites else program, mesh, schedule)
      except ShardzeroError:
        continue
      costs = {k: s(pp) if pp.program is program else simulate(pp, hardware[k])
               for k, s in sims.items()}
      out[(task_name, schedule)] = {
          k: (c.step_time_s, budget is None or c.peak_memory_bytes <= budget)
          for k, c in costs.items()}
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--store", default="docs/scales/results.jsonl")
  parser.add_argument("--min-devices", type=int, default=1024)
  parser.add_argument("--before", required=True, help="FIELD=VALUE: the hardware as it was")
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)
  rows = latest_rows(args.store, args.min_devices)
  priced = price(rows, args.before)
  best = {}
  for (task, schedule), p in priced.items():
    for k in ("before", "after"):
      step, fits = p[k]
      if fits and step < best.get((task, k), (float("inf"),))[0]:
        best[(task, k)] = (step, schedule)
  print(f"\n{len(rows)} stored rows, {len(priced)} distinct plans, "
        f"{len({t for t, _ in priced})} tasks; before: {args.before}\n")
  print("| task | best before (ms) | best after (ms) | same plan |")
  print("|---|---|---|---|")
  tasks = sorted({t for t, _ in best})
  for task in tasks:
    b, a = best.get((task, "before")), best.get((task, "after"))
    cell = lambda x: "nothing fits" if x is None else f"{x[0] * 1e3:.1f}: {x[1]}"
    same = "yes" if b and a and b[1] == a[1] else "**no**"
    print(f"| {task} | {cell(b)} | {cell(a)} | {same} |")
  ratios = defaultdict(lambda: {"before": [], "after": []})
  for r in rows:
    p = priced.get((r["task"], r["schedule"]))
    if p is None:
      continue
    for k in ("before", "after"):
      step, fits = p[k]
      b = best.get((r["task"], k))
      if b is not None:
        ratios[r["agent"]][k].append(step / b[0] if fits else float("inf"))
  print("\n| agent | tasks | mean ratio before | after | worst before | after |")
  print("|---|---:|---:|---:|---:|---:|")
  mean = lambda xs: sum(xs) / len(xs)
  for agent, rs in sorted(ratios.items()):
    print(f"| {agent} | {len(rs['after'])} | {mean(rs['before']):.3f} | {mean(rs['after']):.3f} "
          f"| {max(rs['before']):.2f} | {max(rs['after']):.2f} |")
  if args.json:
    Path(args.json).write_text(json.dumps(
        [{"task": t, "schedule": s, **{k: {"step_time_s": v[0], "fits": v[1]}
                                       for k, v in p.items()}}
         for (t, s), p in priced.items()], indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

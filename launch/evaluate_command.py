"""`shardzero evaluate`: agents x tasks, against the best strategy known for each task."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from launch import report

HELP = "evaluate agents on tasks across models, meshes and hardware"

DESCRIPTION = """\
Runs every agent on every task (a model on a mesh, hardware and memory budget) and reports
each one's predicted step time as a ratio to the best strategy known for the task: the fastest
that fits the budget over every agent ever evaluated on it, experts included (every task gets
the expert agent: the family's expert strategies, or for a model of your own the generic hand
schedules).
Results are kept in --store, one JSON line per (agent, agent version, task), so a re-run
evaluates only what is missing and best-known figures only improve. Results priced by an
earlier cost model are not compared with the current one's; the fastest plans among them are
priced again under it (rows of agent replay:..., in no table) and count in the best known.

Agents:
  expert                  the best of the family's expert strategies (of the generic hand
                          schedules for a model of your own)
  random, greedy          uniformly random legal actions; one-step look-ahead
  beam[:STEPS]            beam search of width 4 (default 200 environment steps)
  mcts[:SIMS]             Monte-Carlo tree search (default 100 simulations)
  ilp[:SECONDS]           integer program over the actions (HiGHS; default 60 s limit)
  policy:RUN              a trained policy, greedy decoding (kept up to the line's best state)
  policy+mcts:RUN[:SIMS]  policy-guided MCTS (default 16 simulations)
  policy+guard:RUN        greedy decoding checked against the hand schedules (the best of
                          them all wins), as `shardzero propose` answers
  policy+mcts+guard:RUN[:SIMS]
                          policy-guided MCTS checked the same way

Where the step has a scanned layer stack, every agent but random and the raw policies also
tries its plan pipelined over the mesh's outermost axis at a few micro-batch counts, deciding
the other axes itself (the expert: the pipelining hand schedules), the best of those also
interleaved (but the guarded policies'), and keeps the better. Where a plan is over the memory
budget, the expert, the ILP and the policies end it cut into micro-batches (Microbatch(k))
where a cut fits or comes closer. Where attention heads do not divide an axis Megatron splits
over, the expert and the guarded policies also try their Megatron plans after HeadPadding.
The guarded policies also try the fastest plans over the budget with their activations
recomputed (Remat(), then cut into micro-batches where that alone does not fit).

Tasks come from --suite (bundled: quick, scales, external; or a YAML file: launch/suites.py) or
--models x --meshes x --hardware x --memory-budget. Prints a table per number of devices and a
summary per agent and scale (mean ratio, share within 10%, decision time); --json, --csv,
--plots and --markdown write the same results for machines, spreadsheets and people.
"""

EXAMPLES = """\
examples:
  shardzero evaluate --suite quick --jobs 2
  shardzero evaluate --models heldout --meshes "batch=4,model=2;batch=32,model=8" \\
      --batch-per-device 2 --agents expert,greedy,mcts:64,ilp,policy:runs/demo
  shardzero evaluate --suite scales --agents expert,ilp,policy:runs/demo --jobs 2 \\
      --markdown docs/scales.md --plots docs/scales
"""


def add_parser(sub) -> None:
  p = sub.add_parser("evaluate", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--suite", help="a bundled suite (quick, scales, external) or a YAML suite file")
  p.add_argument("--models", help="corpus names, families, splits (train, heldout, real, "
                 "external) or module:function, separated by ',' or ';' (knobs like batch=8 "
                 "stay with the model before them)")
  p.add_argument("--meshes", help="';'-separated meshes, e.g. 'batch=4,model=2;batch=32,model=8'")
  p.add_argument("--hardware", default="h100", help="comma-separated hardware; default h100")
  p.add_argument("--memory-budget", default="device",
                 help="comma-separated budgets: device (default), bytes like 16GiB, or a "
                 "fraction in (0, 1] from the smallest expert peak to the data-parallel peak")
  p.add_argument("--preset", default="mini", help="preset of families and splits; default mini")
  p.add_argument("--batch-per-device", type=int, help="weak scaling: a corpus model's batch "
                 "is this times the mesh's devices")
  p.add_argument("--agents", help="comma-separated agents (default: the suite's, or "
                 "expert,greedy,mcts:64,ilp)")
  p.add_argument("--store", default="runs/evaluate/results.jsonl",
                 help="the results store (JSON lines); default runs/evaluate/results.jsonl")
  p.add_argument("--jobs", type=int, default=1, help="worker processes; default 1")
  p.add_argument("--launcher", choices=("local", "ray"), default="local",
                 help="where tasks run: processes on this machine (default) or Ray tasks on "
                 "a Ray cluster, one CPU each (pip install -e '.[ray]')")
  p.add_argument("--address", metavar="HOST:PORT|auto", help="--launcher ray: the cluster to "
                 "join (auto: the one this node belongs to; default: Ray on this machine with "
                 "--jobs CPUs). policy:RUN directories must be paths every node sees")
  p.add_argument("--max-steps", type=int, default=24, help="actions per episode; default 24")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", metavar="PATH", help="write tasks, results and summary as JSON "
                 "('-': stdout, instead of the tables)")
  p.add_argument("--csv", metavar="PATH", help="write one row per (agent, task) as CSV")
  p.add_argument("--plots", metavar="DIR", help="write the plots (PNG) to DIR")
  p.add_argument("--markdown", metavar="PATH", help="write a report (tables, plot links)")
  p.set_defaults(run=run)


def split_models(text: str) -> list[str]:
  """`heldout,gpt:350m,batch=256;t5:mini` -> heldout, gpt:350m,batch=256, t5:mini: models are
  separated by ';' or ',', and a `key=value` knob stays with the model before it."""
  out: list[str] = []
  for part in text.split(";"):
    models: list[str] = []
    for piece in filter(None, (q.strip() for q in part.split(","))):
      if models and "=" in piece and ":" not in piece:
        models[-1] += "," + piece
      else:
        models.append(piece)
    out += models
  return out


def _tasks(args):
  from launch.evaluation import check_budget
  from launch.suites import Suite, load_suite, task_group
  from partitioner.cost import load_hardware
  from partitioner.errors import ShardzeroError
  if args.suite and (args.models or args.meshes):
    raise ShardzeroError("give either --suite or --models/--meshes, not both")
  if args.suite:
    suite = load_suite(args.suite)
  else:
    if not args.models or not args.meshes:
      raise ShardzeroError("give --suite, or --models and --meshes")
    hardware = [h.strip() for h in args.hardware.split(",")]
    budgets = [check_budget(b) for b in args.memory_budget.split(",")]
    tasks = task_group(split_models(args.models),
                   [m.strip() for m in args.meshes.split(";") if m.strip()],
                   hardware, budgets, args.batch_per_device, args.preset)
    suite = Suite("command line", "", ("expert", "greedy", "mcts:64", "ilp"), tuple(tasks))
  for hw in {t.hardware for t in suite.tasks}:
    load_hardware(hw)
  if not suite.tasks:
    raise ShardzeroError("no tasks to evaluate")
  return suite, list(dict.fromkeys(suite.tasks))


def run(args) -> int:
  from launch import evaluation as ev
  from partitioner.errors import ShardzeroError
  if args.jobs < 1 or args.max_steps < 1:
    raise ShardzeroError("--jobs and --max-steps must be positive")
  if args.address and args.launcher != "ray":
    raise ShardzeroError("--address is a setting of --launcher ray")
  suite, tasks = _tasks(args)
  agents = [a.strip() for a in args.agents.split(",")] if args.agents else list(suite.agents)
  specs = [ev.parse_agent(a) for a in agents]
  agents = list(dict.fromkeys(str(s) for s in specs))
  versions = {str(s): ev.agent_version(s) for s in specs}
  versions.setdefault("expert", ev.agent_version(ev.parse_agent("expert")))
  store = ev.ResultsStore(args.store)
  if store.damaged:
    print(f"shardzero evaluate: {store.damaged} damaged line(s) in {args.store} skipped",
          file=sys.stderr)
  wanted, units = [], []
  for task in tasks:
    # Every task gets the expert (the generic hand schedules for a user's program).
    names = [a for a in agents if a != "expert"] + ["expert"]
    keys = [(a, versions[a], task.key, args.max_steps, args.seed) for a in names]
    wanted += [k for k in keys if k[0] in agents]
    missing = tuple((k[0], k[1]) for k in keys if not store.has(k))
    if missing:
      units.append(ev.Unit(task, missing, args.max_steps, args.seed))
  quiet = args.json == "-"
  _run_units(units, store, args.jobs, quiet, args.launcher, args.address)
  replayed, best = 0, store.best_known()
  for task in tasks:   # plans an earlier cost model found best, priced under this one
    plans = ev.earlier_plans(store, task.key, best.get(task.key, float("inf")))
    if plans:
      rows = ev.replay_plans(task, plans)
      store.add(rows)
      replayed += len(rows)
  if replayed and not quiet:
    print(f"evaluate: {replayed} plan(s) of earlier cost models priced again under this one "
          "(rows of agent replay:..., counted in the best known)", file=sys.stderr)
  rows = ev.with_ratios(store.latest(wanted), store.best_known(), store.feasible())
  summary = ev.summarize(rows)
  splits = sorted({ev.split_of(r["model"]) for r in rows}, key=list(SPLIT_TITLES).index)
  by_split = {s: ev.summarize(rows, s) for s in splits} if len(splits) > 1 else {}
  result = {"suite": suite.name, "agents": agents, "versions": versions,
            "tasks": [t.key for t in tasks], "results": rows, "summary": summary,
            "summary_heldout": by_split.get("heldout"), "summary_by_split": by_split}
  sections = [("summary", summary)] + [(f"summary: {SPLIT_TITLES[s]}", by_split[s])
                                       for s in splits if by_split]
  if args.json:
    report.write_json(result, args.json)
  if args.csv:
    _write_csv(rows, args.csv)
  plots = _plot(rows, args.plots) if args.plots else []
  if args.markdown:
    _write_markdown(args, suite, agents, rows, sections, plots)
  if not quiet:
    _print(rows, sections, agents)
  errors = [r for r in rows if "error" in r]
  for r in errors:
    print(f"shardzero evaluate: {r['agent']} on {r['task']}: {r['error']}", file=sys.stderr)
  return 1 if errors else 0


def _run_units(units, store, jobs: int, quiet: bool, launcher: str = "local",
               address: str | None = None) -> None:
  """Evaluates the units, in `jobs` processes or as Ray tasks, storing each unit's rows as
  they arrive."""
  from launch.evaluation import run_unit
  from launch.progress import Ticker
  if not units:
    return
  total = sum(len(u.agents) for u in units)
  ticker = Ticker("evaluate", total, unit=" results") if not quiet else None
  done = 0

  def finished(unit, rows):
    nonlocal done
    store.add(rows)
    done += len(rows)
    if ticker:
      ticker.update(done, f"last: {unit.task.model} on {unit.task.mesh}")

  if ticker:
    ticker.update(0, f"{len(units)} tasks, " + (
        f"{jobs} job(s)" if launcher == "local" else f"Ray at {address or 'this machine'}"))

  with ticker or contextlib.nullcontext():
    if launcher == "ray":
      from launch import ray_run
      ray_run.run_units(run_unit, units, finished, address, jobs)
      return
    if jobs == 1:
      for unit in units:
        finished(unit, run_unit(unit))
      return
    import concurrent.futures
    import multiprocessing
    context = multiprocessing.get_context("spawn")   # workers start their own JAX
    from concurrent.futures.process import BrokenProcessPool
    from partitioner.errors import ShardzeroError
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
      futures = {pool.submit(run_unit, u): u for u in units}
      try:
        for f in concurrent.futures.as_completed(futures):
          finished(futures[f], f.result())
      except BrokenProcessPool as e:   # a worker killed: most often for memory
        raise ShardzeroError(
            f"a worker process died (killed for memory? each holds a task's programs); the "
            f"{done} of {total} results finished are kept in {store.path}: run the same "
            f"command again, with fewer --jobs, to finish the rest") from e


def _ratio(r) -> str:
  if "error" in r:
    return "error"
  return f"{r['ratio']:.2f}" + ("" if r["fits"] else "!")


# Where the tasks' programs come from (`launch.evaluation.split_of`), as summaries title them.
SPLIT_TITLES = {"train": "corpus families trained on", "heldout": "held-out corpus families",
                "real": "HuggingFace models of the real-models tier",
                "external": "external programs, never trained on", "user": "your own programs"}
SUMMARY_COLUMNS = ["agent", "devices", "tasks", "mean ratio", "worst", "within 10%",
                   "nothing fits", "decision s"]


def _summary_row(s) -> list[str]:
  fmt = lambda x, f: "-" if x is None else f.format(x)
  return [s["agent"], str(s["devices"]), str(s["tasks"]), fmt(s["mean_ratio"], "{:.3f}"),
          fmt(s["worst_ratio"], "{:.2f}"), fmt(s["within_10pct"], "{:.0%}"),
          str(s["nothing_fits"]), fmt(s["mean_decide_s"], "{:.2f}")]


def _print(rows, sections, agents) -> None:
  out = report.console()
  by_task: dict = {}
  for r in rows:
    by_task.setdefault((r["devices"], r["task"]), {})[r["agent"]] = r
  for devices in sorted({d for d, _ in by_task}):
    table_rows = []
    for (d, key), cells in sorted(by_task.items()):
      if d != devices:
        continue
      first = next(iter(cells.values()))
      table_rows.append([first["model"], first["mesh"], first["hardware"], first["budget"]] +
                        [_ratio(cells[a]) if a in cells else "" for a in agents])
    out.print(report.table(f"{devices} devices: step time / best known (! over the memory "
                           "budget)", ["model", "mesh", "hardware", "budget"] + agents,
                           table_rows))
  for title, rows_ in sections:
    if rows_:
      out.print(report.table(title, SUMMARY_COLUMNS, [_summary_row(s) for s in rows_]))


def _write_csv(rows, path: str) -> None:
  import csv
  columns = ["agent", "version", "model", "mesh", "hardware", "budget", "devices", "parameters",
             "ops", "budget_bytes", "step_time_s", "peak_memory_bytes", "fits", "best_known_s",
             "ratio", "within", "decide_s", "simulations", "actions", "schedule", "error"]
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def _plot(rows, directory: str) -> list[str]:
  """Ratio to best known against devices (mean per agent) and against model size, and
  decision time against program size; the PNG paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(directory, exist_ok=True)
  ok = [r for r in rows if r.get("ratio") is not None]
  agents = list(dict.fromkeys(r["agent"] for r in ok))
  # One look per agent however many there are: 20 colours, then other markers and dashes.
  colours, markers = plt.get_cmap("tab20").colors, "osD^vP*Xph"
  style = {a: {"color": colours[i % 20], "marker": markers[i % len(markers)]}
           for i, a in enumerate(agents)}
  lines = {a: "-" if i < 20 else "--" for i, a in enumerate(agents)}
  legend = dict(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  paths = []

  def save(fig, name):
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

  fig, ax = plt.subplots(figsize=(9, 4.5))
  for a in agents:
    devices = sorted({r["devices"] for r in ok if r["agent"] == a})
    means = [sum(r["ratio"] for r in ok if r["agent"] == a and r["devices"] == d) /
             sum(1 for r in ok if r["agent"] == a and r["devices"] == d) for d in devices]
    ax.plot(devices, means, ls=lines[a], label=a, **style[a])
  ticks = sorted({r["devices"] for r in ok})
  ax.set_xscale("log", base=2)
  ax.set_xticks(ticks, [str(d) for d in ticks])
  ax.set(xlabel="devices", ylabel="mean step time / best known",
         title="ratio to best known by scale")
  ax.axhline(1.1, color="grey", lw=0.8, ls="--")
  ax.legend(**legend)
  save(fig, "ratio_by_devices.png")

  def scatter(x, y, title, **axes):
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for a in agents:
      ax.plot(*zip(*sorted((x(r), y(r)) for r in ok if r["agent"] == a)), ls="", alpha=0.7,
              label=a, **style[a])
    ax.set(xscale="log", title=title, **axes)
    ax.legend(**legend)
    return fig, ax

  fig, ax = scatter(lambda r: r["parameters"], lambda r: r["ratio"],
                    "ratio to best known by model size", xlabel="parameters",
                    ylabel="step time / best known")
  ax.axhline(1.1, color="grey", lw=0.8, ls="--")
  save(fig, "ratio_by_size.png")
  fig, _ = scatter(lambda r: r["ops"], lambda r: max(r["decide_s"], 1e-4),
                   "decision time by program size", yscale="log",
                   xlabel="ops in the training step", ylabel="decision time (s)")
  save(fig, "decision_time.png")
  return paths


def _write_markdown(args, suite, agents, rows, sections, plots) -> None:
  fmt = lambda x, f: "-" if x is None else f.format(x)
  here = os.path.dirname(os.path.abspath(args.markdown))
  command = "shardzero evaluate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else \
      "shardzero evaluate"
  lines = [f"# Agents across scales: suite `{suite.name}`", "",
           "Generated by `" + command + "`. " + (suite.description + ". " if suite.description
                                                  else "") +
           "Ratios are predicted step time over the best known strategy of the task (the "
           "fastest that fits, over every agent and expert evaluated on it, and the best plans "
           "of earlier cost models priced again); `!` marks a plan "
           "over the memory budget. Decision time is wall time per episode on the machine that "
           "ran it."]
  for title, rows_ in sections:
    if rows_:
      lines += ["", f"## {title[0].upper()}{title[1:]}", "",
                "| " + " | ".join(SUMMARY_COLUMNS) + " |",
                "|---|" + "---:|" * (len(SUMMARY_COLUMNS) - 1)]
      lines += ["| " + " | ".join(_summary_row(s)) + " |" for s in rows_]
  lines += [""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, here)})" for p in plots]
  lines += ["", "## Per task", "", "| model | mesh | hardware | budget | " +
            " | ".join(agents) + " |", "|---|---|---|---|" + "---:|" * len(agents)]
  by_task: dict = {}
  for r in rows:
    by_task.setdefault((r["devices"], r["task"]), {})[r["agent"]] = r
  for (_, key), cells in sorted(by_task.items()):
    first = next(iter(cells.values()))
    lines.append(f"| {first['model']} | {first['mesh']} | {first['hardware']} | "
                 f"{first['budget']} | " + " | ".join(_ratio(cells[a]) if a in cells else ""
                                                      for a in agents) + " |")
  ilp = [r for r in rows if "ilp" in r]
  if ilp:
    lines += ["", "## The ILP", "", "Variables and constraints after candidate selection, "
              "build (simulations of one- and two-action states) and solve time, HiGHS' MIP "
              "gap (first round), rounds kept, and the linearisation error: the simulator's serial "
              "time of the first round's actions replayed over that ILP's objective, less one.", "",
              "| model | mesh | variables | constraints | rounds | build s | solve s | gap | "
              "linearisation error | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['mesh']} | {r['ilp']['variables']} | "
              f"{r['ilp']['constraints']} | {r['ilp']['rounds']} | {r['ilp']['build_s']:.1f} | "
              f"{r['ilp']['solve_s']:.2f} | {fmt(r['ilp']['gap'], '{:.3f}')} | "
              f"{r['ilp']['linearisation_error']:+.1%} | {_ratio(r)} |" for r in ilp]
  with open(args.markdown, "w") as f:
    f.write("\n".join(lines) + "\n")

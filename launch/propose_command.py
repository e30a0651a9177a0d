"""`shardzero propose MODEL --mesh ... --policy RUN_DIR`: a strategy from a trained policy."""

from __future__ import annotations

import argparse
import time

from launch import report
from launch.partition_command import _mesh_size, layout_lines
from launch.search_command import _cost_dict, strategy_result
from launch.runtime import collector_paused

HELP = "propose a partitioning strategy with a trained policy"

# The share of the memory budget a proposal leaves free. Predicted peaks are within 10% of, or
# over, XLA's footprint in 36 of 41 cases of the corpus and real models (docs/validation.md,
# "Memory across the corpus"); the rest are 12-35% under.
MARGIN = 0.1

DESCRIPTION = """\
Loads the policy checkpointed in --policy (a 'shardzero train' run directory; by default the
policy shipped with shardzero, policies/default), decodes a strategy for MODEL over --mesh
greedily (the most likely legal action other than finish, until three in a row have not beaten
the line's best state, which is kept: the simulator costs each state anyway, so it, not the
policy, says where the line ends), or with --search mcts lets the policy's prior and value
guide --budget simulations of tree search (and keeps the greedy strategy where the search found
nothing better).

The answer is never worse than a hand schedule: the generic ones (data parallelism, ZeRO 1-3,
HSDP, Megatron and their mixtures; the family's expert strategies for corpus models) are
costed from the same start, and the best plan by the simulator wins: what fits the memory
budget before what does not, then the fastest. The output says which won and by how much.
A plan fits when its predicted peak is within the budget less --memory-margin (10% by
default), since the simulator's peaks can run under XLA's footprint (by 1-14% on the steps
measured on one H200: docs/validation.md; raise it where a plan must not fail). The fastest
plans that do not fit (where nothing fits, or where they are faster than the answer) are tried
again with the batch cut into 2, 4, 8... micro-batches (Microbatch: gradient accumulation;
activations shrink, nothing else changes); the fastest that fits with the fewest is the
answer if it beats the whole-batch one. Where the step has a scanned layer stack, the program
is also pipelined over the mesh's outermost axis at 8 micro-batches a stage, the policy
deciding the other axes, and the pipelining hand schedules (ptd-p) are costed at the same
count. Where nothing fits even so, it says so, shows the closest, and exits with status 1.

--verify runs the answer on local devices against the unpartitioned program.
"""

EXAMPLES = """\
examples:
  shardzero propose t5:mini --mesh batch=4,model=2
  shardzero propose moe:mini --mesh batch=4,model=2 --policy runs/demo --search mcts --budget 50
  shardzero propose my_model.py:train_step --mesh data=8,fsdp=4,tensor=8 --memory-budget 60GiB
  shardzero propose mlp:mini --mesh batch=4,model=2 --verify --json -
"""


def add_parser(sub) -> None:
  p = sub.add_parser("propose", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="corpus name or module:function / path.py:function")
  p.add_argument("--mesh", required=True, help="named mesh axes, e.g. batch=4,model=2")
  p.add_argument("--policy", metavar="RUN_DIR", help="a training run directory; default: the "
                 "shipped policy (policies/default)")
  p.add_argument("--hardware", default="h100", help="catalog name or spec file; default h100")
  p.add_argument("--memory-budget", metavar="BYTES", help="bytes per device, e.g. 16GiB")
  p.add_argument("--memory-margin", type=float, default=MARGIN, metavar="FRACTION",
                 help="share of the budget kept free: the plan's predicted peak must fit in "
                      f"(1 - FRACTION) of it; default {MARGIN} (the simulator's peaks run "
                      "under XLA:CPU's by more than that in 7 of 42 validation cases, "
                      "docs/validation.md); 0 plans to the byte")
  p.add_argument("--search", choices=("greedy", "mcts"), default="greedy",
                 help="greedy decoding (default) or policy-guided MCTS")
  p.add_argument("--budget", type=int, default=50, help="MCTS simulations; default 50")
  p.add_argument("--max-steps", type=int, help="actions at most; default: the run's")
  p.add_argument("--verify", action="store_true", help="run it on local devices and compare")
  p.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout)")
  p.set_defaults(run=run, host_devices=lambda: _mesh_size(p))


def run(args) -> int:
  import corpus
  import policies
  from agents.guard import fit_with_microbatches, play_guarded
  from environments import EnvConfig, PartitioningEnv, Task, parse_bytes
  from learners.policies import load_policy
  from partitioner.cost import load_hardware
  from partitioner.errors import ShardzeroError
  from partitioner.mesh import Mesh
  from partitioner.tactics import HeadPadding, ProgramRewrite, Remat

  Mesh.parse(args.mesh)
  load_hardware(args.hardware)
  if args.budget < 1:
    raise ShardzeroError("--budget must be positive")
  run_dir = args.policy or policies.DEFAULT
  policy = load_policy(run_dir)
  version = policy.version
  max_steps = args.max_steps or policy.max_steps
  if max_steps < 1:
    raise ShardzeroError("--max-steps must be positive")
  if not 0 <= args.memory_margin < 1:
    raise ShardzeroError(f"--memory-margin must be in [0, 1), got {args.memory_margin}")
  stated = (parse_bytes(args.memory_budget) if args.memory_budget else
            load_hardware(args.hardware).hbm_bytes)
  budget = int(stated * (1 - args.memory_margin))
  if corpus.family_of(args.model):
    corpus.parse(args.model)
  task = Task(args.model, args.mesh, args.hardware, budget)
  out = report.console()
  status = out.status(f"tracing {args.model}") if not args.json else None
  if status:
    status.start()
  try:
    env = PartitioningEnv(task, config=EnvConfig(max_steps=max_steps))
    env.reset()
    if status:
      status.update("deciding with the policy and costing the hand schedules")
    with collector_paused():
      guarded = play_guarded(env, policy, args.search, args.budget)
  finally:
    if status:
      status.stop()
  ctx = env.context
  found, cost = ctx.unfolded(env.partitioned), env.exact_cost
  result = strategy_result(env, args.model, f"policy ({args.search})", guarded.best_hand,
                           guarded.policy_s, guarded.simulations)
  result.update({
      "memory_budget_bytes": stated, "memory_margin": args.memory_margin,
      "planned_budget_bytes": budget,
      "policy": run_dir, "policy_version": version, "policy_time_s": guarded.policy_s,
      "answer": result["schedule"] if guarded.fits else None, "fits": guarded.fits,
      "winner": guarded.winner, "guard": guarded.summary(),
      "guard_time_s": guarded.guard_s,
      "policy_plan": {"schedule": guarded.policy_schedule, "step_time_s": guarded.policy_step_s,
                      "peak_memory_bytes": guarded.policy_peak_bytes,
                      "within_budget": guarded.policy_fits},
      "hand_schedules": [{"name": h.name, "schedule": h.schedule, "error": h.error} |
                         ({} if h.cost is None else
                          {"step_time_s": h.cost.step_time_s,
                           "peak_memory_bytes": h.cost.peak_memory_bytes,
                           "within_budget": bool(h.fits)}) for h in guarded.hand],
      "cost_ratio_to_expert": None if guarded.best_hand is None else
      cost.step_time_s / guarded.best_hand.cost.step_time_s})
  if status:
    status.start()
    status.update("trying the faster plans that do not fit with micro-batches, and pipelines")
  try:
    from launch.auto import solve
    from launch.evaluation import AgentSpec, pipeline_decider
    kind = "policy+mcts+guard" if args.search == "mcts" else "policy+guard"
    decide, per_stage = pipeline_decider(AgentSpec(kind, run_dir, args.budget), ctx)
    began = time.perf_counter()
    with collector_paused():
      micro = fit_with_microbatches(ctx, guarded, decide=decide, solver=solve,
                                    per_stage=per_stage)
    result["fit_time_s"] = time.perf_counter() - began
    result["decide_time_s"] = guarded.policy_s + guarded.guard_s + result["fit_time_s"]
  finally:
    if status:
      status.stop()
  if micro is not None:
    before = cost.step_time_s
    found, cost = micro.pp, micro.cost
    base = "the policy's plan" if micro.base == "policy" else f"the hand schedule {micro.base}"
    gain = (f"fits, {before / cost.step_time_s:.2f}x faster than the answer it replaces"
            if guarded.fits else "fits")
    stages = found.program.stages
    rewrites = [t for t in found.schedule if isinstance(t, ProgramRewrite)]
    padded = [t for t in rewrites if isinstance(t, HeadPadding)]
    parts = [f"its attention heads padded to split ({t})" for t in padded]
    recomputed = any(isinstance(t, Remat) for t in rewrites)
    if recomputed:
      parts.append("its activations recomputed in the backward pass (Remat)")
    if stages > 1:
      parts.append(f"its step streamed through {stages} pipeline stages in {micro.k} "
                   "micro-batches")
    elif micro.k > 1:
      parts.append(f"its batch cut into {micro.k} micro-batches")
    how = " and ".join(parts)
    how = "with " + how + (" (costed outside the search environment, which cannot play such "
                           "a rewrite)" if stages > 1 or padded or recomputed else "")
    result.update({
        "schedule": found.decided, "tactics": found.decided.split("; "),
        "cost": _cost_dict(cost, ctx.budget), "answer": found.decided, "fits": True,
        "winner": micro.base if stages > 1 else
        f"{micro.base} with {'; '.join(str(t) for t in rewrites)}",
        "microbatches": micro.k,
        "guard": f"{guarded.summary()}; {how}, {base} {gain}",
        "cost_ratio_to_expert": None if guarded.best_hand is None else
        cost.step_time_s / guarded.best_hand.cost.step_time_s})
  result["layouts"] = {found.program.input_names[k]: str(lay)
                       for k, lay in found.program.layouts.items()}
  fits = result["fits"]
  if args.verify and fits:
    from partitioner.verify import verify
    workload = corpus.load(args.model, abstract=False)
    verification = verify(found, workload.args)
    result["verified"] = bool(verification.ok)
    result["max_abs_err"] = float(verification.max_abs_err)
  if args.json:
    report.write_json(result, args.json)
  if args.json != "-":
    _print(out, result, found, ctx, guarded)
  if not fits:
    return 1
  return 0 if result.get("verified", True) else 1


def _print(out, result, found, ctx, guarded) -> None:
  h, ms = report.human_bytes, lambda s: f"{s * 1e3:.3f} ms"
  out.print(f"[bold]{result['model']}[/bold] on {found.mesh} ({found.mesh.device_count} devices, "
            f"{result['hardware']}), memory budget {h(result['memory_budget_bytes'])} per "
            f"device, planned within {h(ctx.budget)} ({result['memory_margin']:.0%} kept "
            "free: predicted peaks can run under XLA's); "
            f"{result['decision_points']} decision points, {result['actions']} actions")
  if result["fits"]:
    out.print(f"answer: {result['schedule'] or '(none: unpartitioned)'}")
  else:
    out.print(f"[bold]no plan fits in {h(result['memory_budget_bytes'])} per device[/bold] "
              f"less the margin ({h(ctx.budget)}), neither the policy's nor a hand "
              f"schedule's; the closest needs {h(result['cost']['peak_memory_bytes'])}:")
    out.print(f"closest (does not fit): {result['schedule'] or '(none: unpartitioned)'}")
  for line in layout_lines(found.program):
    out.print(line)
  for r in found.reports:
    out.print(f"  {r.tactic}: " + (f"{len(r.targets)} values tiled" if r.targets or not r.notes
                                    else r.notes[0]))
  hand, plan = guarded.best_hand, result["policy_plan"]
  rows = [("answer" if result["fits"] else "closest", result["cost"]["step_time_s"],
           result["cost"]["peak_memory_bytes"], result["cost"]["within_budget"],
           result["winner"])]
  if "microbatches" in result or not guarded.policy_won:
    rows.append(("the policy's plan", plan["step_time_s"], plan["peak_memory_bytes"],
                 plan["within_budget"], plan["schedule"] or "(none)"))
  elif hand is not None:
    rows.append(("best hand schedule", hand.cost.step_time_s, hand.cost.peak_memory_bytes,
                 hand.fits, hand.name))
  table_rows = [(label, ms(step), h(peak), "yes" if fits else "no", what)
                for label, step, peak, fits, what in rows]
  table_rows.append(("unpartitioned", ms(result["unpartitioned_step_time_s"]), "", "", ""))
  out.print(report.table("predicted per device", ["plan", "step", "peak memory", "in budget",
                                                  "from"], table_rows,
                         justify={1: "right", 2: "right"}))
  out.print(f"guard: {result['guard']}; {len(guarded.hand)} hand schedules costed in "
            f"{result['guard_time_s']:.2f} s")
  sims = result["simulations"]
  out.print(f"policy: {result['policy']} (version {result['policy_version']}), decided in "
            f"{result['policy_time_s']:.3f} s" + (f" with {sims} simulations" if sims else "") +
            f"; {result['decide_time_s']:.2f} s in all with the hand schedules, micro-batches "
            "and pipelines")
  if "verified" in result:
    out.print(f"verify: {'OK' if result['verified'] else 'MISMATCH'} (max abs error "
              f"{result['max_abs_err']:.2e})")

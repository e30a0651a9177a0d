"""`shardzero search MODEL --mesh ... --agent mcts --budget N`: find a strategy by search."""

from __future__ import annotations

import argparse
import time

from launch import report

HELP = "search for a partitioning strategy (expert, random, greedy, beam, mcts)"

AGENTS = ("mcts", "beam", "greedy", "random", "expert")

DESCRIPTION = """\
Partition MODEL over --mesh by searching over tactics in the partitioning environment: each
action tiles a decision point (the same input in every layer, or its optimizer state) along a
dimension over a mesh axis, applies a manual tactic (BatchParallel, Megatron, ZeRO stage 1-3,
EmbeddingSharding, ExpertParallel, SequenceParallel over an axis), or finishes. Every state
is costed by the simulator on --hardware; a state over --memory-budget is penalised.

Agents:
  mcts     Monte-Carlo tree search (PUCT, transpositions); --budget simulations
  beam     beam search of width --width; --budget environment steps at most
  greedy   one-step look-ahead while the score improves
  random   uniformly random legal actions (--seed)
  expert   the best of the corpus' expert strategies for the model family (the generic hand
           schedules for a model of your own)

Prints the schedule found, its predicted cost next to the best expert strategy's (the
family's, or the generic hand schedules' for a model of your own), and the search time. The
schedule replays with 'shardzero partition --tactics'.
"""

EXAMPLES = """\
examples:
  shardzero search gpt:small,d_model=512,vocab=8192,seq=256,batch=32 --mesh batch=4,model=8 \\
      --memory-budget 100MiB --agent mcts --budget 200
  shardzero search moe:small --mesh batch=2,model=4 --agent greedy --json -
"""


def add_parser(sub) -> None:
  p = sub.add_parser("search", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="corpus name or module:function / path.py:function")
  p.add_argument("--mesh", required=True, help="named mesh axes, e.g. batch=4,model=8 (the last "
                 "axis is the one expert strategies use for model parallelism)")
  p.add_argument("--hardware", default="h100", help="catalog name or spec file; default h100")
  p.add_argument("--memory-budget", metavar="BYTES",
                 help="bytes per device, e.g. 16GiB or 512MiB (default: the device's memory)")
  p.add_argument("--agent", choices=AGENTS, default="mcts", help="default mcts")
  p.add_argument("--budget", type=int, default=200,
                 help="simulations (mcts) or environment steps (beam); default 200")
  p.add_argument("--width", type=int, default=4, help="beam width; default 4")
  p.add_argument("--max-steps", type=int, default=24, help="actions per episode; default 24")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout, "
                 "instead of the tables)")
  p.set_defaults(run=run)


def _cost_dict(cost, budget) -> dict:
  return {**cost.to_dict(), "memory_budget_bytes": budget,
          "within_budget": cost.peak_memory_bytes <= budget}


def strategy_result(env, model: str, agent: str, expert, search_s: float,
                    simulations: int) -> dict:
  """What `search` and `propose` report (and write as JSON) for the strategy an episode of
  `env` found, next to the best expert's (None where no expert strategy applies)."""
  ctx = env.context
  found, cost = ctx.unfolded(env.partitioned), env.exact_cost
  return {
      "model": model, "mesh": dict(ctx.mesh.axes), "hardware": ctx.hardware.name,
      "agent": agent, "schedule": found.strategy, "tactics": [str(t) for t in found.schedule],
      "cost": _cost_dict(cost, ctx.budget),
      "unpartitioned_step_time_s": env.restart_clone().exact_cost.step_time_s,
      "score": env.score(),
      "expert": None if expert is None else {
          "name": expert.name, "schedule": expert.schedule,
          "cost": _cost_dict(expert.cost, ctx.budget)},
      "search_time_s": search_s, "simulations": simulations,
      "actions": len(ctx.actions), "decision_points": len(ctx.points),
  }


def make_actor(name: str, env, args):
  from agents.search.baselines import GreedyActor, RandomActor
  from agents.search.beam import BeamActor
  from agents.search.expert import ExpertActor
  from agents.search.mcts import MCTSActor
  if args.budget < 1 or args.width < 1:
    from partitioner.errors import ShardzeroError
    raise ShardzeroError("--budget and --width must be positive")
  return {"mcts": lambda: MCTSActor(env, budget=args.budget, seed=args.seed),
          "beam": lambda: BeamActor(env, width=args.width, budget=args.budget),
          "greedy": lambda: GreedyActor(env),
          "random": lambda: RandomActor(args.seed),
          "expert": lambda: ExpertActor(env)}[name]()


def run(args) -> int:
  import corpus
  from agents.environment_loop import EnvironmentLoop
  from agents.search.expert import best_expert, evaluate_experts
  from agents.loggers import InMemoryLogger
  from environments import EnvConfig, PartitioningEnv, Task, parse_bytes
  from partitioner.cost import load_hardware
  from partitioner.mesh import Mesh
  from partitioner.errors import ShardzeroError

  Mesh.parse(args.mesh)
  load_hardware(args.hardware)
  if args.max_steps < 1:
    raise ShardzeroError("--max-steps must be positive")
  budget = parse_bytes(args.memory_budget) if args.memory_budget else None
  if corpus.family_of(args.model):
    corpus.parse(args.model)   # a bad knob fails before tracing
  task = Task(args.model, args.mesh, args.hardware, budget)
  out = report.console()
  status = out.status(f"tracing {args.model} and building the action space") \
      if not args.json else None
  if status:
    status.start()
  try:
    env = PartitioningEnv(task, seed=args.seed, config=EnvConfig(max_steps=args.max_steps))
    actor = make_actor(args.agent, env, args)
    if status:
      status.update(f"searching with {args.agent}")
    start = time.perf_counter()
    record = EnvironmentLoop(env, actor, logger=InMemoryLogger()).run_episode()
    search_s = time.perf_counter() - start
    episode_return = float(record["episode_return"])
    found = env.context.unfolded(env.partitioned)
    if status:
      status.update("costing the expert strategies")
    expert = best_expert(evaluate_experts(env.restart_clone()))
  finally:
    if status:
      status.stop()
  ctx = env.context
  result = strategy_result(env, args.model, args.agent, expert, search_s,
                           getattr(actor, "simulations", len(env.history)))
  result["episode_return"] = episode_return
  if args.json:
    report.write_json(result, args.json)
    if args.json == "-":
      return 0
  _print(out, result, found, ctx)
  return 0


def _print(out, result, found, ctx) -> None:
  h, ms = report.human_bytes, lambda s: f"{s * 1e3:.3f} ms"
  out.print(f"[bold]{result['model']}[/bold] on {found.mesh} ({found.mesh.device_count} devices, "
            f"{result['hardware']}), memory budget {h(ctx.budget)} per device; "
            f"{result['decision_points']} decision points, {result['actions']} actions")
  out.print(f"{result['agent']}: {result['simulations']} simulations in "
            f"{result['search_time_s']:.2f} s")
  out.print(f"schedule: {result['schedule'] or '(none: unpartitioned)'}")
  for r in found.reports:
    out.print(f"  {r.tactic}: " + (f"{len(r.targets)} values tiled" if r.targets or not r.notes
                                    else r.notes[0]))
  rows = [("found", result["cost"])]
  if result["expert"]:
    rows.append((f"best expert ({result['expert']['name']})", result["expert"]["cost"]))
  rows.append(("unpartitioned", {"step_time_s": result["unpartitioned_step_time_s"]}))
  table_rows = []
  for label, c in rows:
    if "compute_s" in c:
      table_rows.append((label, ms(c["step_time_s"]), ms(c["compute_s"]), ms(c["exposed_comm_s"]),
                         h(c["peak_memory_bytes"]), "yes" if c["within_budget"] else "no"))
    else:
      table_rows.append((label, ms(c["step_time_s"]), "", "", "", ""))
  out.print(report.table("predicted per device", ["strategy", "step", "compute",
                                                  "exposed comm", "peak memory", "in budget"],
                         table_rows, justify={1: "right", 2: "right", 3: "right", 4: "right"}))
  if result["expert"]:
    out.print(f"expert schedule: {result['expert']['schedule']}")

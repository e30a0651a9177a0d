"""`shardzero propose MODEL --mesh ... --policy RUN_DIR`: a strategy from a trained policy."""

from __future__ import annotations

import argparse

from launch import report
from launch.partition_command import _mesh_size
from launch.search_command import _print, strategy_result

HELP = "propose a partitioning strategy with a trained policy"

DESCRIPTION = """\
Loads the policy checkpointed in --policy (a 'shardzero train' run directory), decodes a
strategy for MODEL over --mesh greedily (the most likely legal action other than finish, until
three in a row have not beaten the line's best state, which is kept: the simulator costs each
state anyway, so it, not the policy, says where the line ends), or with
--search mcts lets the policy's prior and value guide --budget simulations of tree search (and
keeps the greedy strategy where the search found nothing better), applies it with the
partitioner and prints the schedule with its predicted step time and memory next to the best
expert strategy (corpus models). --verify runs the partitioned program on local devices against
the unpartitioned one.
"""

EXAMPLES = """\
examples:
  shardzero propose t5:mini --mesh batch=4,model=2 --policy runs/demo
  shardzero propose moe:mini --mesh batch=4,model=2 --policy runs/demo --search mcts --budget 50
  shardzero propose mlp:mini --mesh batch=4,model=2 --policy runs/demo --verify --json -
"""


def add_parser(sub) -> None:
  p = sub.add_parser("propose", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="corpus name or module:function / path.py:function")
  p.add_argument("--mesh", required=True, help="named mesh axes, e.g. batch=4,model=2")
  p.add_argument("--policy", required=True, metavar="RUN_DIR", help="a training run directory")
  p.add_argument("--hardware", default="h100", help="catalog name or spec file; default h100")
  p.add_argument("--memory-budget", metavar="BYTES", help="bytes per device, e.g. 16GiB")
  p.add_argument("--search", choices=("greedy", "mcts"), default="greedy",
                 help="greedy decoding (default) or policy-guided MCTS")
  p.add_argument("--budget", type=int, default=50, help="MCTS simulations; default 50")
  p.add_argument("--max-steps", type=int, help="actions at most; default: the run's")
  p.add_argument("--verify", action="store_true", help="run it on local devices and compare")
  p.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout)")
  p.set_defaults(run=run, host_devices=lambda: _mesh_size(p))


def run(args) -> int:
  import corpus
  from agents.search.expert import best_expert, evaluate_experts
  from environments import EnvConfig, PartitioningEnv, Task, parse_bytes
  from agents.decoding import play_policy
  from learners.policies import load_policy
  from partitioner.cost import load_hardware
  from partitioner.errors import ShardzeroError
  from partitioner.mesh import Mesh

  Mesh.parse(args.mesh)
  load_hardware(args.hardware)
  if args.budget < 1:
    raise ShardzeroError("--budget must be positive")
  policy = load_policy(args.policy)
  version = policy.version
  max_steps = args.max_steps or policy.max_steps
  if max_steps < 1:
    raise ShardzeroError("--max-steps must be positive")
  budget = parse_bytes(args.memory_budget) if args.memory_budget else None
  is_corpus = args.model.partition(":")[0] in corpus.FAMILIES
  if is_corpus:
    corpus.parse(args.model)
  task = Task(args.model, args.mesh, args.hardware, budget)
  out = report.console()
  env = PartitioningEnv(task, config=EnvConfig(max_steps=max_steps))
  env.reset()
  policy_s, simulations = play_policy(env, policy, args.search, args.budget)
  ctx = env.context
  found, cost = ctx.unfolded(env.partitioned), env.exact_cost
  expert = best_expert(evaluate_experts(env.restart_clone())) if is_corpus else None
  result = strategy_result(env, args.model, f"policy ({args.search})", expert, policy_s,
                           simulations)
  result.update({"policy": args.policy, "policy_version": version, "policy_time_s": policy_s,
                 "cost_ratio_to_expert": None if expert is None else
                 cost.step_time_s / expert.cost.step_time_s})
  if args.verify:
    from partitioner.verify import verify
    workload = corpus.load(args.model, abstract=False)
    verification = verify(found, workload.args)
    result["verified"] = bool(verification.ok)
    result["max_abs_err"] = float(verification.max_abs_err)
  if args.json:
    report.write_json(result, args.json)
    if args.json == "-":
      return 0
  _print(out, result, found, ctx)
  out.print(f"policy: {args.policy} (version {version}), decided and applied in "
            f"{policy_s:.3f} s" + (f" with {simulations} simulations" if simulations else ""))
  if result["cost_ratio_to_expert"] is not None:
    out.print(f"step time / best expert: {result['cost_ratio_to_expert']:.3f}")
  if args.verify:
    out.print(f"verify: {'OK' if result['verified'] else 'MISMATCH'} (max abs error "
              f"{result['max_abs_err']:.2e})")
    return 0 if result["verified"] else 1
  return 0

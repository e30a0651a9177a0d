"""A trained policy on the held-out split: greedy `propose` and policy-guided search against
plain MCTS, in cost relative to the best expert strategy and in simulations.

For each held-out task of the run (its config's held-out models on its evaluation mesh, at the
device's memory and at the run's tight budget): the greedy policy's cost ratio and decision
time; then MCTS with the heuristic prior and MCTS with the policy's prior and value at growing
budgets, reporting each one's ratio and the fewest simulations that reach within 10% of the
expert (issue 6). At a tight budget the expert is the fastest that fits, and a strategy over
the budget (marked `!`) never counts as within 10%. Prints a table and writes
benchmarks/results/policy.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.search.expert import best_expert, evaluate_experts  # noqa: E402
from agents.decoding import play_policy  # noqa: E402
from learners.policies import load_policy  # noqa: E402
from agents.search.mcts import MCTSActor  # noqa: E402
from agents.search.planning import play  # noqa: E402
from benchmarks.reporting import print_table, write_results  # noqa: E402
from launch.runtime import relax_gc  # noqa: E402
from environments import EnvConfig, PartitioningEnv, Task  # noqa: E402

WITHIN = 1.10


def _outcome(env, expert_time) -> tuple[float, bool]:
  """(step time / the expert's, whether the peak memory fits the task's budget)."""
  return env.cost.step_time_s / expert_time, env.fits


def _mcts(env, budget, expert_time, policy=None) -> tuple[float, bool]:
  """Plain MCTS (heuristic prior), or policy-guided MCTS, from `env`'s start."""
  trial = env.clone()
  if policy is None:
    play(trial, MCTSActor(env, budget=budget).plan(env.clone()).actions)
  else:
    play_policy(trial, policy, "mcts", budget)
  return _outcome(trial, expert_time)


def measure(task: Task, policy, budgets) -> dict:
  env = PartitioningEnv(task, config=EnvConfig(max_steps=policy.max_steps))
  env.reset()
  expert = best_expert(evaluate_experts(env.restart_clone()))
  expert_time = expert.cost.step_time_s
  greedy = env.clone()
  seconds, _ = play_policy(greedy, policy, "greedy")
  ratio, fits = _outcome(greedy, expert_time)
  row = {"model": task.model, "mesh": task.mesh, "budget_bytes": env.context.budget,
         "tight": task.memory_budget is not None, "expert": expert.name,
         "greedy_ratio": ratio, "greedy_fits": fits, "greedy_time_s": seconds,
         "greedy_schedule": greedy.partitioned.strategy, "plain": {}, "guided": {}}
  for b in budgets:
    row["plain"][b] = _mcts(env, b, expert_time)
    row["guided"][b] = _mcts(env, b, expert_time, policy)
  for kind in ("plain", "guided"):
    reached = [b for b in budgets if row[kind][b][0] <= WITHIN and row[kind][b][1]]
    row[f"{kind}_simulations_to_10pct"] = reached[0] if reached else None
  return row


def _ratio(outcome) -> str:
  ratio, fits = outcome
  return f"{ratio:.2f}" + ("" if fits else "!")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--policy", default="runs/demo", help="a 'shardzero train' run directory")
  parser.add_argument("--budgets", default="4,8,16,32,64,128", help="MCTS simulation budgets")
  parser.add_argument("--out", default="benchmarks/results/policy.json")
  args = parser.parse_args(argv)
  relax_gc()   # as the shardzero command does
  policy = load_policy(args.policy)
  from learners.run_config import RunConfig
  config = RunConfig.load(args.policy)
  budgets = [int(b) for b in args.budgets.split(",")]
  tasks = config.heldout_tasks() + config.heldout_tasks(tight=True)
  rows = [measure(t, policy, budgets) for t in tasks]
  fmt = lambda n: "-" if n is None else str(n)
  header = ("model", "budget", "greedy ratio", "greedy s", "plain sims", "guided sims")
  print_table(header, [(r["model"], f"{r['budget_bytes'] / 2**30:.3g} GiB",
                        _ratio((r["greedy_ratio"], r["greedy_fits"])),
                        f"{r['greedy_time_s']:.3f}", fmt(r["plain_simulations_to_10pct"]),
                        fmt(r["guided_simulations_to_10pct"])) for r in rows], 14,
              trail=["   ratio at each budget (plain / guided; ! over the memory budget)"] + [
                  "   " + "  ".join(
                      f"{b}:{_ratio(r['plain'][b])}/{_ratio(r['guided'][b])}" for b in budgets)
                  for r in rows])
  write_results(args.out, "policy", rows, policy=args.policy, policy_version=policy.version,
                within=WITHIN)
  return 0


if __name__ == "__main__":
  sys.exit(main())

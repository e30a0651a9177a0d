"""Partitioning-environment speed on the GPT and MoE corpus entries, as agents use it.

For each task: the one-off set-up (trace, action space, static arrays, first simulation);
steps per second of random legal episodes that reach new states (apply the tactic, update the
SPMD plan, re-simulate, mask and observe) and the share of that time the garbage collector
took; steps per second replaying the same episodes (the task's cache of states, what search
revisits cost); and MCTS simulations per second.
Goal (issue 5): at least 200 new-state steps/s for a 12-layer GPT task on one core. Deep
models are played folded (three layers, the middle one weighted) unless `--no-fold`; the
12-layer GPT is measured both ways.
Prints a table and writes benchmarks/results/environment.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from agents.search.mcts import MCTSActor  # noqa: E402
from benchmarks.reporting import print_table, write_results  # noqa: E402
from launch.runtime import relax_gc  # noqa: E402
from environments import PartitioningEnv, Task  # noqa: E402
from environments.tasks import TASKS as TASK_CACHE  # noqa: E402

TASKS = (
    ("gpt 12 layers", Task("gpt:125m", "batch=4,model=8"), True),
    ("gpt 12 layers, unfolded", Task("gpt:125m", "batch=4,model=8"), False),
    ("gpt 2 layers", Task("gpt:small,d_model=768,heads=12,vocab=50304,seq=1024,batch=64",
                          "batch=4,model=8"), True),
    ("moe 2 layers", Task("moe:small", "batch=2,model=4"), True),
)


@contextlib.contextmanager
def collector_time():
  """Seconds the garbage collector runs inside the block (`gc.callbacks`), in a list of one: a
  share of the step that wall-clock noise on a shared machine does not move."""
  spent, started = [0.0], [0.0]

  def callback(phase, info):
    if phase == "start":
      started[0] = time.perf_counter()
    else:
      spent[0] += time.perf_counter() - started[0]

  gc.callbacks.append(callback)
  try:
    yield spent
  finally:
    gc.callbacks.remove(callback)


def measure(label: str, task: Task, steps: int, simulations: int, fold: bool = True,
            seed: int = 0) -> dict:
  TASK_CACHE.contexts.clear()
  start = time.perf_counter()
  env = PartitioningEnv(task, seed=seed, fold=fold)
  setup_s = time.perf_counter() - start
  ctx = env.context
  # Random episodes: every step reaches a state not seen before (checked below).
  rng = np.random.default_rng(seed)
  episodes, taken = [], 0
  start = time.perf_counter()
  with collector_time() as gc_s:
    while taken < steps:
      ts, actions = env.reset(), []
      while not ts.last() and taken < steps:
        a = int(rng.choice(env.legal_actions()))
        ts = env.step(a)
        actions.append(a)
        taken += 1
      episodes.append(actions)
  fresh_s = time.perf_counter() - start
  new_states = len(ctx.states)
  # The same episodes again, from the cache.
  start = time.perf_counter()
  for actions in episodes:
    env.reset()
    for a in actions:
      env.step(a)
  cached_s = time.perf_counter() - start
  env.reset()
  actor = MCTSActor(env, budget=simulations)
  start = time.perf_counter()
  plan = actor.plan(env.clone())
  mcts_s = time.perf_counter() - start
  return {"task": label, "model": task.model, "mesh": task.mesh, "folded": bool(ctx.folding),
          "ops": ctx.program.num_ops,
          "values": len(ctx.program.values), "actions": len(ctx.actions), "setup_s": setup_s,
          "steps": taken, "new_states": new_states, "steps_per_s": taken / fresh_s,
          "gc_share": gc_s[0] / fresh_s,
          "cached_steps_per_s": taken / cached_s, "mcts_simulations": plan.simulations,
          "mcts_simulations_per_s": plan.simulations / mcts_s}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=40, help="random steps per task")
  parser.add_argument("--simulations", type=int, default=40, help="MCTS simulations per task")
  parser.add_argument("--out", default="benchmarks/results/environment.json")
  parser.add_argument("--no-fold", action="store_true", help="play every task unfolded")
  args = parser.parse_args(argv)
  relax_gc()   # as the shardzero command does
  rows = [measure(label, task, args.steps, args.simulations, fold and not args.no_fold)
          for label, task, fold in TASKS]
  header = ("task", "ops played", "actions", "set-up", "steps/s", "gc", "cached steps/s",
            "MCTS sims/s")
  print_table(header, [(r["task"], r["ops"], r["actions"], f"{r['setup_s']:.1f} s",
                        f"{r['steps_per_s']:.1f}", f"{100 * r['gc_share']:.1f}%",
                        f"{r['cached_steps_per_s']:.0f}",
                        f"{r['mcts_simulations_per_s']:.1f}") for r in rows], 16)
  write_results(args.out, "environment", rows, goal_steps_per_s=200)
  return 0


if __name__ == "__main__":
  sys.exit(main())

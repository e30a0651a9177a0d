"""AlphaZero actors' throughput, as `shardzero train` runs them, without Reverb or a learner.

Each actor plays the default training distribution (the train split at the mini preset, two
meshes, full and tight budgets) with an untrained network: MCTS with the network's prior and
value at every move. The first episodes trace the models and fill the caches; the timed
episodes after them are what a long run's actor sees. With `--processes 1,2` it runs one actor
process, then two side by side (their timed windows start together), so the table shows how
throughput scales with actor processes when nothing else takes the cores (in `train` the
learner and the Reverb server share them). Prints a table and writes
benchmarks/results/actor.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.core import VariableSource  # noqa: E402
from agents.environment_loop import EnvironmentLoop  # noqa: E402
from agents.loggers import InMemoryLogger  # noqa: E402
from benchmarks.reporting import print_table, write_results  # noqa: E402
from launch.runtime import relax_gc  # noqa: E402
from environments import PartitioningEnv  # noqa: E402
from environments.observations import Sizes  # noqa: E402
from environments.tasks import load_program  # noqa: E402
from learners.run_config import RunConfig  # noqa: E402


class _Fixed(VariableSource):
  def __init__(self, params):
    self._params = params

  def get_variables(self, names):
    return [(self._params, 0)]


def _actor_process(args, seed: int, barrier, results) -> None:
  """One actor: warm-up episodes, wait for the others, then the timed episodes."""
  relax_gc()   # as the shardzero command does
  config = RunConfig(algorithm="alphazero", settings={"simulations": args.simulations})
  builder = config.builder()
  networks = builder.make_networks()
  distribution = config.train_tasks()
  for model in distribution.models:
    load_program(model)
  env = PartitioningEnv(distribution, seed=seed, config=config.env_config(),
                        pad_to=Sizes(*config.sizes))
  actor = builder.make_actor(env, networks, _Fixed(builder.init_params(networks)),
                             seed=seed, update_period=config.variable_update_period)
  loop = EnvironmentLoop(env, actor, logger=InMemoryLogger())
  start = time.perf_counter()
  loop.run(num_episodes=args.warmup)
  warmup_s = time.perf_counter() - start
  barrier.wait()
  start = time.perf_counter()
  steps = loop.run(num_episodes=args.episodes)
  results.put({"tasks": len(distribution.tasks()), "warmup_s": warmup_s,
               "seconds": time.perf_counter() - start, "steps": steps,
               "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})


def _run(args, processes: int) -> dict:
  """`processes` actors side by side; episodes/s summed over them."""
  context = multiprocessing.get_context("spawn")
  barrier, results = context.Barrier(processes), context.Queue()
  workers = [context.Process(target=_actor_process, args=(args, args.seed + i, barrier, results))
             for i in range(processes)]
  for worker in workers:
    worker.start()
  rows = []
  while len(rows) < processes:
    try:
      rows.append(results.get(timeout=5))
    except queue.Empty:
      failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
      if failed:   # the others would wait at the barrier for ever
        for worker in workers:
          worker.terminate()
        raise SystemExit(f"an actor process exited with code {failed[0]}")
  for worker in workers:
    worker.join()
  return {"processes": processes, "tasks": rows[0]["tasks"], "simulations": args.simulations,
          "warmup_episodes": args.warmup, "episodes": args.episodes * processes,
          "warmup_s": max(r["warmup_s"] for r in rows),
          "seconds": max(r["seconds"] for r in rows),
          "episodes_per_s": sum(args.episodes / r["seconds"] for r in rows),
          "steps_per_s": sum(r["steps"] / r["seconds"] for r in rows),
          "max_rss_gib": max(r["max_rss_gib"] for r in rows)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--episodes", type=int, default=60, help="timed episodes per actor")
  parser.add_argument("--warmup", type=int, default=20, help="episodes before timing")
  parser.add_argument("--simulations", type=int, default=16, help="MCTS simulations per move")
  parser.add_argument("--processes", default="1,2",
                      help="actor process counts to run, one after the other (e.g. 1,2)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="benchmarks/results/actor.json")
  args = parser.parse_args(argv)
  try:
    counts = [int(n) for n in args.processes.split(",")]
  except ValueError:
    parser.error(f"--processes takes counts like 1,2, not {args.processes!r}")
  if not counts or min(counts) < 1:
    parser.error("--processes counts must be at least 1")
  rows = [_run(args, n) for n in counts]
  print_table(("processes", "tasks", "sims/move", "episodes", "episodes/s", "steps/s",
               "vs first", "max RSS"),
              [(r["processes"], r["tasks"], args.simulations, r["episodes"],
                f"{r['episodes_per_s']:.2f}", f"{r['steps_per_s']:.1f}",
                f"{r['steps_per_s'] / rows[0]['steps_per_s']:.2f}x",
                f"{r['max_rss_gib']:.2f} GiB") for r in rows], 11)
  write_results(args.out, "actor", rows, cores=os.cpu_count())
  return 0


if __name__ == "__main__":
  sys.exit(main())

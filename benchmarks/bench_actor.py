"""One AlphaZero actor's throughput, as `shardzero train` runs it, without Reverb.

The actor plays the default training distribution (the train split at the mini preset, two
meshes, full and tight budgets) with an untrained network: MCTS with the network's prior and
value at every move. The first episodes trace the models and fill the caches; the timed
episodes after them are what a long run's actor sees. Prints a table and writes
benchmarks/results/actor.json.
"""

from __future__ import annotations

import argparse
import os
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
from launch.training import RunConfig  # noqa: E402


class _Fixed(VariableSource):
  def __init__(self, params):
    self._params = params

  def get_variables(self, names):
    return [(self._params, 0)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--episodes", type=int, default=60, help="timed episodes")
  parser.add_argument("--warmup", type=int, default=20, help="episodes before timing")
  parser.add_argument("--simulations", type=int, default=16, help="MCTS simulations per move")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="benchmarks/results/actor.json")
  args = parser.parse_args(argv)
  relax_gc()   # as the shardzero command does
  config = RunConfig(algorithm="alphazero", settings={"simulations": args.simulations})
  builder = config.builder()
  networks = builder.make_networks()
  distribution = config.train_tasks()
  for model in distribution.models:
    load_program(model)
  env = PartitioningEnv(distribution, seed=args.seed, config=config.env_config(),
                        pad_to=Sizes(*config.sizes))
  actor = builder.make_actor(env, networks, _Fixed(builder.init_params(networks)),
                             seed=args.seed, update_period=config.variable_update_period)
  loop = EnvironmentLoop(env, actor, logger=InMemoryLogger())
  start = time.perf_counter()
  loop.run(num_episodes=args.warmup)
  warmup_s = time.perf_counter() - start
  start = time.perf_counter()
  steps = loop.run(num_episodes=args.episodes)
  timed_s = time.perf_counter() - start
  row = {"tasks": len(distribution.tasks()), "simulations": args.simulations,
         "warmup_episodes": args.warmup, "warmup_s": warmup_s, "episodes": args.episodes,
         "seconds": timed_s, "episodes_per_s": args.episodes / timed_s,
         "steps_per_s": steps / timed_s,
         "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
  print_table(("tasks", "sims/move", "episodes", "episodes/s", "steps/s", "max RSS"),
              [(row["tasks"], args.simulations, args.episodes, f"{row['episodes_per_s']:.2f}",
                f"{row['steps_per_s']:.1f}", f"{row['max_rss_gib']:.2f} GiB")], 12)
  write_results(args.out, "actor", [row])
  return 0


if __name__ == "__main__":
  sys.exit(main())

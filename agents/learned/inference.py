"""Using a trained policy: load a run's checkpoint and play it in an environment.

Needs neither Reverb nor TensorFlow, so `propose` and the `Auto` tactic stay light.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from agents.learned.actors import make_policy, make_search_fns
from agents.learned.builders import make_builder
from agents.learned.networks import Networks
from learners import checkpointing
from partitioner.errors import ShardzeroError

CONFIG = "config.json"


class TrainedPolicy(NamedTuple):
  networks: Networks
  params: Any
  version: int          # learner updates behind the parameters
  config: dict          # the run's config.json
  run_dir: str

  @property
  def max_steps(self) -> int:
    """The episode length it was trained for."""
    return int(self.config.get("max_steps", 12))


def load_policy(run_dir: str) -> TrainedPolicy:
  """The policy checkpointed in a `shardzero train` run directory: the moving average of the
  parameters where the learner kept one (what its evaluator played), else the latest."""
  path = os.path.join(run_dir, CONFIG)
  if not os.path.exists(path):
    raise ShardzeroError(f"{run_dir} is not a training run (no {CONFIG})")
  with open(path) as f:
    config = json.load(f)
  builder = make_builder(config.get("algorithm", "ppo"), config.get("settings"),
                         tuple(config.get("sizes", (4096, 8192, 512))), config.get("network"))
  networks = builder.make_networks()
  state = checkpointing.load(run_dir)["learner"]["state"]
  params = state[0]
  if builder.evaluation_variables == "average" and len(state) > 3 and state[3] is not None:
    params = state[3]
  shapes = lambda tree: jax.tree_util.tree_map(np.shape, tree)
  if shapes(params) != shapes(builder.init_params(networks)):
    raise checkpointing.CheckpointError(
        f"the checkpoint in {run_dir} does not fit the network of its {CONFIG} (trained on "
        "observations of another shardzero version?); train it again")
  return TrainedPolicy(networks, params, int(np.asarray(state[2])), config, run_dir)


def play_policy(env, policy: TrainedPolicy, search: str = "greedy",
                budget: int = 50) -> tuple[float, int]:
  """Plays `policy` in `env` from its current state to the end: greedy decoding (the most
  likely legal action until finish), or MCTS with `budget` simulations guided by the policy's
  prior and value, which also decodes greedily and plays the better of the two (a small search
  need not pass through the greedy line). Returns (seconds spent deciding and applying,
  simulations). The first call for a size bucket compiles; the timing is taken after a
  warm-up call."""
  from agents.mcts import MCTSActor
  from agents.planning import path_to, play
  networks, params = policy.networks, policy.params
  greedy = make_policy(networks, evaluation=True)
  greedy(params, jax.random.PRNGKey(0), env.observation())[0].block_until_ready()   # compile

  def decode(env):
    done, observation = env.done, env.observation()
    while not done:
      action, _, _ = greedy(params, jax.random.PRNGKey(0), observation)
      ts = env.step(int(action))
      observation, done = ts.observation, ts.last()

  start = time.perf_counter()
  simulations = 0
  if search == "mcts":
    prior_fn, value_fn = make_search_fns(networks, lambda: params)
    mcts = MCTSActor(env, budget=budget, prior_fn=prior_fn, value_fn=value_fn)
    plan = mcts.plan(env.clone())
    simulations = plan.simulations
    line = env.clone()
    decode(line)
    better = line.score() > plan.score + 1e-12
    play(env, path_to(line, len(env.history)) if better else plan.actions)
  elif search == "greedy":
    decode(env)
  else:
    raise ShardzeroError(f"unknown policy search {search!r}; use greedy or mcts")
  return time.perf_counter() - start, simulations

"""Expert demonstrations as search targets (Acme's learning from demonstrations).

The corpus' expert strategies are what a policy should at least rediscover. A demonstration is
the best expert's actions for a task, then finish, each step's target one-hot on the expert's
action and its value target the return to go: the AlphaZero-style learner's replay items, so
the same loss clones the expert (pretraining) or mixes demonstrations into search data.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import numpy as np

from partitioner.errors import ShardzeroError


def expert_moves(env) -> list[int]:
  """The best expert's actions from `env`'s current state, then finish; empty where the task
  has no expert strategies or the best one does not beat the current state (which counts its
  memory penalty: fitting a budget the current state misses is worth a slower step)."""
  from agents.expert import best_expert, evaluate_experts
  try:
    best = best_expert(evaluate_experts(env))
  except ShardzeroError:
    return []
  if best is None or not best.actions or best.score <= env.score():
    return []
  return [*best.actions, env.finish_action]


def expert_demonstrations(tasks: Sequence, sizes, env_config, log=print) -> list[dict]:
  """One demonstration per task (where an expert helps), as replay items of `sizes`."""
  from environments import PartitioningEnv
  items: list[dict] = []
  for task in tasks:
    env = PartitioningEnv(task, config=env_config, pad_to=sizes)
    ts = env.reset()
    observations, actions, rewards = [], [], []
    for action in expert_moves(env):
      if ts.last():
        break
      observations.append(ts.observation)
      actions.append(action)
      ts = env.step(action)
      rewards.append(float(ts.reward))
    for observation, action, ret in zip(observations, actions,
                                        np.cumsum(rewards[::-1])[::-1]):
      visits = np.zeros(sizes.actions, np.float32)
      visits[action] = 1.0
      items.append({"observation": observation, "visits": visits, "version": np.int64(0),
                    "return": np.float32(ret)})
    if log:
      log(f"demonstration: {task.model} on {task.mesh}: {len(actions)} steps")
  if not items:
    raise ShardzeroError("no expert strategy improves any training task: nothing to demonstrate")
  return items


def demonstration_batches(items: Sequence[dict], batch_size: int,
                          seed: int = 0) -> Iterator[dict]:
  """Endless batches of `batch_size` items drawn uniformly, stacked like replay samples."""
  rng = np.random.default_rng(seed)
  while True:
    chosen = [items[i] for i in rng.integers(len(items), size=batch_size)]
    yield jax.tree_util.tree_map(lambda *xs: np.stack(xs), *chosen)

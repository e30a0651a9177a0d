"""Demonstrations as search targets (Acme's learning from demonstrations).

The corpus' expert strategies are what a policy should at least rediscover. A demonstration is
the best known strategy for a task, then finish, each step's target one-hot on its action and
its value target the return to go: the AlphaZero-style learner's replay items, so the same
loss clones it (pretraining) or mixes demonstrations into search data. The best known strategy
is the best expert's (cut into micro-batches where only so it fits), or, with `simulations`,
what a plain MCTS of that many simulations finds where it scores higher: on about half the training tasks search beats every expert (an MLP
wants its batch axis for Megatron, a small ResNet one axis of data parallelism), and cloning
only the experts teaches those weaker strategies.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import numpy as np

from agents.decoding import pruned
from environments.actions import ends_episode
from partitioner.errors import ShardzeroError


def _best_expert(env) -> tuple[list[int], float]:
  """The expert agent's actions (without finish; where no expert plan fits, the fastest cut
  into micro-batches where that fits) and score, or ([], -inf)."""
  from agents.search.expert import ExpertActor
  try:
    plan = ExpertActor(env).plan(env.clone())
  except ShardzeroError:
    return [], -np.inf
  moves = [a for a in plan.actions if a != env.finish_action]
  return (moves, plan.score) if moves else ([], -np.inf)


PRUNE_TOLERANCE = 2e-3   # a searched move worth less than this share of the step is dropped


def demonstration_moves(env, simulations: int = 0) -> list[int]:
  """The best known strategy's actions from `env`'s current state, then finish: the best
  expert's, or a plain MCTS plan of `simulations` (0: none, pruned of moves that barely help)
  where it scores higher. Empty where neither beats the current state (whose score counts its
  memory penalty: fitting a budget the current state misses is worth a slower step)."""
  moves, score = _best_expert(env)
  if simulations:
    from agents.search.mcts import MCTSActor
    plan = MCTSActor(env, budget=simulations).plan(env.clone())
    if plan.score > score + 1e-12:
      # Pruned of moves that gain less than PRUNE_TOLERANCE: search keeps any move that helps
      # at all, and a Tile of one value that saves a few bytes, named after one model's
      # values, teaches a policy nothing that carries over.
      moves, score = pruned(env, [a for a in plan.actions if a != env.finish_action],
                            plan.score, PRUNE_TOLERANCE)
  if not moves or score <= env.score():
    return []
  cut = ends_episode(env.action_name(moves[-1]))   # it ends the episode itself
  return moves if cut else [*moves, env.finish_action]


def demonstration_items(tasks: Sequence, sizes, env_config, log=print,
                        simulations: int = 0) -> list[dict]:
  """One demonstration per task (where the best known strategy helps), as replay items of
  `sizes`; `simulations` as in `demonstration_moves`. Each task's context (its cached states:
  a search's, 0.1-0.2 GB on the policy recipe's larger tasks) is dropped once the next task is
  of another model or mesh (the budgets of one share it), rather than kept in the process's
  cache: the learner held 13.6 GB after the recipe's 168 demonstrations so."""
  from environments import PartitioningEnv
  from environments.partitioning_env import task_context
  from environments.tasks import TaskCache
  cache = TaskCache(contexts=1)
  items: list[dict] = []
  for task in tasks:
    env = PartitioningEnv(task_context(task, sizes, cache=cache), config=env_config)
    ts = env.reset()
    observations, actions, rewards = [], [], []
    for action in demonstration_moves(env, simulations):
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

"""Baseline agents: uniformly random legal actions, and greedy one-step look-ahead."""

from __future__ import annotations

import numpy as np

from agents.core import Actor
from agents.search.planning import Plan, PlanningActor
from environments.protocols import SearchEnvironment


class RandomActor(Actor):
  """A uniformly random legal action (finish included), from the observation's mask."""

  def __init__(self, seed: int = 0):
    self._rng = np.random.default_rng(seed)

  def select_action(self, observation) -> int:
    return int(self._rng.choice(np.flatnonzero(observation["action_mask"])))

  def observe_first(self, timestep) -> None:
    pass

  def observe(self, action, next_timestep) -> None:
    pass

  def update(self, wait: bool = False) -> None:
    pass


class GreedyActor(PlanningActor):
  """Takes the legal action whose next state scores best, while that improves the score;
  then finishes. Each decision simulates every legal action once."""

  def plan(self, env: SearchEnvironment) -> Plan:
    current, best, best_score, sims = env.score(), None, None, 0
    for a in env.legal_actions():
      if a == env.finish_action:
        continue
      trial = env.clone()
      trial.step(a)
      sims += 1
      s = trial.score()
      if best_score is None or s > best_score:
        best, best_score = int(a), s
    if best is None or best_score <= current + 1e-12:
      return Plan((env.finish_action,), current, sims, 0.0)
    return Plan((best,), best_score, sims, 0.0)   # re-planned at the next step

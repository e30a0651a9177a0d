"""Actors that plan with copies of the environment they act in.

As Acme's MCTS agent plans with an environment model, these actors plan with `env.clone()`:
the real partitioner and simulator, shared through the task's cache of states. A planner
returns the actions to take from the current state (ending with finish); the actor plays them.
"""

from __future__ import annotations

import abc
import time
from typing import NamedTuple

from agents.core import Actor
from environments.actions import ends_episode
from environments.protocols import SearchEnvironment


class Plan(NamedTuple):
  actions: tuple[int, ...]     # from the state planned from, ending with finish
  score: float                 # env.score() of the state the plan reaches
  simulations: int             # environment steps the search took (cached or not)
  seconds: float


class PlanningActor(Actor):
  """Plans once per episode (at its first action) and plays the plan."""

  def __init__(self, environment: SearchEnvironment):
    self._env = environment
    self._plan: list[int] = []
    self.last_plan: Plan | None = None
    self.simulations = 0          # environment steps spent planning in this episode
    self.search_seconds = 0.0

  @abc.abstractmethod
  def plan(self, env: SearchEnvironment) -> Plan:
    """The actions to take from `env`'s state (a clone the planner may step)."""

  def select_action(self, observation) -> int:
    if not self._plan:
      start = time.perf_counter()
      plan = self.plan(self._env.clone())
      self.last_plan = plan._replace(seconds=time.perf_counter() - start)
      self.simulations += plan.simulations
      self.search_seconds += self.last_plan.seconds
      self._plan = list(plan.actions) or [self._env.finish_action]
    return self._plan.pop(0)

  def observe_first(self, timestep) -> None:
    self._plan = []
    self.simulations, self.search_seconds = 0, 0.0

  def observe(self, action, next_timestep) -> None:
    pass

  def update(self, wait: bool = False) -> None:
    pass


def path_to(env: SearchEnvironment, start: int) -> tuple[int, ...]:
  """The actions `env` took after its first `start` ones, then finish unless it is done."""
  return env.history[start:] + (() if env.done else (env.finish_action,))


def cut_if_over(env: SearchEnvironment) -> tuple[int, ...]:
  """Where `env`'s state is over its memory budget, the action that rewrites the step and ends
  the episode (`Microbatch(k)`, `Remat()`) whose state scores best, if that beats the state as
  it is; else (). The agents that plan a whole schedule at once (the ILP, the experts) end so:
  activations shrink with the micro-batch or once recomputed, so a plan over the budget for
  them fits once rewritten."""
  if env.done or env.fits:
    return ()
  best, best_score = (), env.score()
  for a in env.legal_actions():
    if ends_episode(env.action_name(a)):
      line = env.clone()
      line.step(a)
      if line.score() > best_score:
        best, best_score = (int(a),), line.score()
  return best


def play(env: SearchEnvironment, actions) -> float:
  """Steps `env` through `actions`; returns the sum of rewards."""
  total = 0.0
  for a in actions:
    total += float(env.step(a).reward)
  return total

"""The actor-environment loop (Acme's `acme.environment_loop.EnvironmentLoop`)."""

from __future__ import annotations

import operator
import time
from typing import Optional

import dm_env
import numpy as np
import tree

from agents.core import Actor
from agents.counting import Counter
from agents.loggers import Logger, TerminalLogger


class EnvironmentLoop:
  """Runs episodes of `actor` in `environment`, counting steps and episodes in `counter` and
  writing one record per episode to `logger`."""

  def __init__(self, environment: dm_env.Environment, actor: Actor,
               counter: Optional[Counter] = None, logger: Optional[Logger] = None,
               should_update: bool = True, label: str = "environment_loop"):
    self._environment = environment
    self._actor = actor
    self._counter = counter or Counter()
    self._logger = logger or TerminalLogger(label, time_delta=10.0)
    self._should_update = should_update

  def run_episode(self) -> dict:
    """One episode; returns its record (length, return, steps per second, counts)."""
    start = time.time()
    timestep = self._environment.reset()
    self._actor.observe_first(timestep)
    episode_return = tree.map_structure(np.zeros_like, self._environment.reward_spec()
                                        .generate_value())
    steps = 0
    while not timestep.last():
      action = self._actor.select_action(timestep.observation)
      timestep = self._environment.step(action)
      self._actor.observe(action, next_timestep=timestep)
      if self._should_update:
        self._actor.update()
      steps += 1
      episode_return = tree.map_structure(operator.iadd, episode_return, timestep.reward)
    counts = self._counter.increment(episodes=1, steps=steps)
    elapsed = time.time() - start
    return {"episode_length": steps, "episode_return": episode_return,
            "steps_per_second": steps / elapsed if elapsed > 0 else float("inf"), **counts}

  def run(self, num_episodes: Optional[int] = None, num_steps: Optional[int] = None) -> int:
    """Runs until `num_episodes` episodes or `num_steps` steps (whichever is given; both:
    whichever comes first; neither: forever). Returns the number of steps taken."""
    if num_episodes is not None and num_episodes < 0 or num_steps is not None and num_steps < 0:
      raise ValueError("num_episodes and num_steps must be non-negative")
    episodes = steps = 0
    while not ((num_episodes is not None and episodes >= num_episodes) or
               (num_steps is not None and steps >= num_steps)):
      result = self.run_episode()
      episodes += 1
      steps += result["episode_length"]
      self._logger.write(result)
    return steps

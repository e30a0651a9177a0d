"""Adders that write an actor's experience into Reverb with `client.trajectory_writer`.

Each step is appended once; items reference the steps they span. `SequenceAdder` writes
sequences of T actions (T+1 steps, the last one for bootstrapping) that never cross episodes:
the episode's final observation is appended as a step with `valid = 0` and the sequence is
padded with zero steps. `ReturnAdder` holds an episode back until it ends, then writes one item
per step with the return from that step on (what a value should predict).
"""

from __future__ import annotations

import dm_env
import numpy as np
import tree

from agents.adders import Adder


def _zeros_like(step):
  return tree.map_structure(np.zeros_like, step)


def _end_episode(writer, slice_ms: int = 1000) -> None:
  """`writer.end_episode()`, waiting for the table's rate limiter a second at a time: a wait
  in Reverb's C++ never returns to Python, so a signal (Ctrl-C, the launcher's SIGTERM) could
  not stop an actor whose learner has gone."""
  from reverb import errors
  try:
    writer.end_episode(clear_buffers=True, timeout_ms=slice_ms)
  except errors.DeadlineExceededError:       # the episode has ended; its items are pending
    while True:
      try:
        writer.flush(timeout_ms=slice_ms)
        return
      except errors.DeadlineExceededError:
        pass


class SequenceAdder(Adder):
  """Items of `sequence_length + 1` steps, consecutive items sharing one step.

  A step is {observation, action, reward, discount, valid, **extras}: the action taken at the
  observation, the reward and discount that followed, the extras the actor passed (behaviour
  log-probability, parameter version)."""

  def __init__(self, client, table: str, sequence_length: int, priority: float = 1.0):
    if sequence_length < 1:
      raise ValueError("sequence_length must be at least 1")
    self._client, self._table = client, table
    self._length = sequence_length
    self._priority = priority
    self._writer = client.trajectory_writer(num_keep_alive_refs=sequence_length + 1)
    self._observation = None
    self._steps = 0            # steps appended in the current episode
    self._template = None

  def add_first(self, timestep: dm_env.TimeStep):
    if not timestep.first():
      raise ValueError("add_first needs the first timestep of an episode")
    self.reset()
    self._observation = timestep.observation

  def add(self, action, next_timestep: dm_env.TimeStep, extras=()):
    if self._observation is None:
      raise ValueError("add_first must come before add")
    step = {"observation": self._observation, "action": np.int32(action),
            "reward": np.float32(next_timestep.reward),
            "discount": np.float32(next_timestep.discount), "valid": np.float32(1.0),
            **{k: np.asarray(v) for k, v in dict(extras).items()}}
    self._template = self._template or _zeros_like(step)
    self._append(step)
    self._observation = next_timestep.observation
    if next_timestep.last():
      final = dict(_zeros_like(step), observation=next_timestep.observation)
      self._append(final)
      while (self._steps - 1) % self._length:     # pad the last sequence to full length
        self._append(self._template)
      _end_episode(self._writer)
      self._observation, self._steps = None, 0

  def _append(self, step):
    self._writer.append(step)
    self._steps += 1
    if self._steps > self._length and (self._steps - 1) % self._length == 0:
      trajectory = tree.map_structure(lambda column: column[-(self._length + 1):],
                                      self._writer.history)
      self._writer.create_item(self._table, self._priority, trajectory)

  def reset(self):
    _end_episode(self._writer)
    self._observation, self._steps = None, 0

  def close(self):
    self._writer.close()


class ReturnAdder(Adder):
  """One item per step, {observation, return, **extras}, written when the episode ends."""

  def __init__(self, client, table: str, priority: float = 1.0):
    self._client, self._table, self._priority = client, table, priority
    self._writer = client.trajectory_writer(num_keep_alive_refs=1)
    self._episode: list[tuple[dict, float]] = []
    self._observation = None

  def add_first(self, timestep: dm_env.TimeStep):
    self.reset()
    self._observation = timestep.observation

  def add(self, action, next_timestep: dm_env.TimeStep, extras=()):
    if self._observation is None:
      raise ValueError("add_first must come before add")
    step = {"observation": self._observation, **{k: np.asarray(v) for k, v in dict(extras).items()}}
    self._episode.append((step, float(next_timestep.reward)))
    self._observation = next_timestep.observation
    if next_timestep.last():
      rewards = np.array([r for _, r in self._episode], np.float64)
      returns = np.cumsum(rewards[::-1])[::-1]
      for (step, _), g in zip(self._episode, returns):
        self._writer.append({**step, "return": np.float32(g)})
        self._writer.create_item(self._table, self._priority,
                                 tree.map_structure(lambda column: column[-1], self._writer.history))
      _end_episode(self._writer)
      self._episode, self._observation = [], None

  def reset(self):
    self._episode, self._observation = [], None

  def close(self):
    self._writer.close()

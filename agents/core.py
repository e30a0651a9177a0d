"""Acme's interfaces, with Acme's names and signatures.

dm-acme cannot be installed on Python 3.11 (its only release pins dm-launchpad 0.5.0, which
has no wheel for it, and `import acme` imports launchpad), so the project carries the small
part of Acme it builds on. Code written against `acme.core` reads the same against this.
"""

from __future__ import annotations

import abc
import itertools
from typing import Any, Generic, List, Optional, Sequence, TypeVar

import dm_env

T = TypeVar("T")


class Actor(abc.ABC):
  """Interacts with an environment: picks actions, sees what they did, and updates its policy
  (for example by pulling variables from a learner)."""

  @abc.abstractmethod
  def select_action(self, observation):
    """Samples from the policy and returns an action."""

  @abc.abstractmethod
  def observe_first(self, timestep: dm_env.TimeStep):
    """Makes a first observation of an episode (the timestep `reset` returned)."""

  @abc.abstractmethod
  def observe(self, action, next_timestep: dm_env.TimeStep):
    """Makes an observation of the timestep an action led to."""

  @abc.abstractmethod
  def update(self, wait: bool = False):
    """Brings the actor's variables up to date with its source."""


class VariableSource(abc.ABC):
  """Serves the variables (network parameters...) that actors use."""

  @abc.abstractmethod
  def get_variables(self, names: Sequence[str]) -> List[Any]:
    """The named variable collections, in the order asked for."""


class Worker(abc.ABC):
  """Something that runs, usually forever, in its own thread or process."""

  @abc.abstractmethod
  def run(self):
    """Runs the worker."""


class Saveable(abc.ABC, Generic[T]):
  """An object whose state can be saved and restored (a checkpoint)."""

  @abc.abstractmethod
  def save(self) -> T:
    """The state to checkpoint."""

  @abc.abstractmethod
  def restore(self, state: T):
    """Restores a state that `save` returned."""


class Learner(VariableSource, Worker, Saveable):
  """Updates variables from data; serves them to actors; checkpoints itself.

  `run` steps forever (or `num_steps` times); `step` is one update."""

  @abc.abstractmethod
  def step(self):
    """One update step."""

  def run(self, num_steps: Optional[int] = None) -> None:
    for _ in (range(num_steps) if num_steps is not None else itertools.count()):
      self.step()

  def save(self):
    raise NotImplementedError(f"{type(self).__name__} cannot be saved")

  def restore(self, state):
    raise NotImplementedError(f"{type(self).__name__} cannot be restored")


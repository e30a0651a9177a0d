"""Adders: how an actor's experience reaches replay (Acme's `acme.adders.base.Adder`)."""

from __future__ import annotations

import abc

import dm_env


class Adder(abc.ABC):
  """Turns the stream of (action, timestep) an actor sees into replay items."""

  @abc.abstractmethod
  def add_first(self, timestep: dm_env.TimeStep):
    """The first timestep of an episode."""

  @abc.abstractmethod
  def add(self, action, next_timestep: dm_env.TimeStep, extras=()):
    """An action and the timestep it led to; `extras` (policy logits, parameter version...)
    go with the action."""

  @abc.abstractmethod
  def reset(self):
    """Drops the partial episode (when an episode is abandoned)."""

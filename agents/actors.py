"""What the learned agents' actors share: they pull variables through a `VariableClient` and
pass what they see, with the extras of their last action, to an adder (Acme's
`GenericActor` shape)."""

from __future__ import annotations

from typing import Optional

from agents.adders import Adder
from agents.core import Actor
from agents.variable_client import VariableClient


class AdderActor(Actor):
  """Feeds its adder; `version` is the parameter version it last acted with."""

  def __init__(self, variable_client: VariableClient, adder: Optional[Adder] = None):
    self._client = variable_client
    self._adder = adder
    self._extras: dict = {}

  @property
  def version(self) -> int:
    """The version of the parameters the actor plays (-1 before the first pull)."""
    return self._client.version

  def _params(self):
    if self._client.params is None:
      self._client.update_and_wait()
    return self._client.params

  def observe_first(self, timestep):
    if self._adder:
      self._adder.add_first(timestep)

  def observe(self, action, next_timestep):
    if self._adder:
      self._adder.add(action, next_timestep, self._extras)

  def update(self, wait: bool = False):
    self._client.update(wait)

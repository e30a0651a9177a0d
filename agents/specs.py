"""Environment specs (Acme's `acme.specs`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import dm_env


class EnvironmentSpec(NamedTuple):
  """What an agent needs to know of an environment to build its networks."""
  observations: Any
  actions: Any
  rewards: Any
  discounts: Any


def make_environment_spec(environment: dm_env.Environment) -> EnvironmentSpec:
  return EnvironmentSpec(observations=environment.observation_spec(),
                         actions=environment.action_spec(),
                         rewards=environment.reward_spec(),
                         discounts=environment.discount_spec())

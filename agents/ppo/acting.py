"""PPO's actor: samples from the policy (argmax when evaluating) and hands the behaviour
log-probability and parameter version to its adder."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from agents.actors import AdderActor
from agents.adders import Adder
from agents.ppo.networks import Policy
from agents.variable_client import VariableClient


class PolicyActor(AdderActor):

  def __init__(self, policy: Policy, variable_client: VariableClient,
               adder: Optional[Adder] = None, seed: int = 0):
    super().__init__(variable_client, adder)
    self._policy = policy
    self._key = jax.random.PRNGKey(seed)

  def select_action(self, observation) -> int:
    params = self._params()
    self._key, key = jax.random.split(self._key)
    action, log_prob, value = self._policy(params, key, observation)
    self._extras = {"log_prob": np.float32(log_prob), "version": np.int64(self.version)}
    return int(action)

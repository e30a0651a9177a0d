"""The policy PPO acts with: a sample (or the argmax) of the graph network's masked logits."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from agents.networks import Networks
from environments.observations import trimmed

# policy(params, key, observation) -> (action, log_prob, value)
Policy = Callable


def make_policy(networks: Networks, evaluation: bool = False) -> Policy:
  """A jitted policy on one observation: sample (or argmax) a legal action. The observation's
  padding is trimmed first (one compilation per size bucket)."""

  def policy(params, key, observation):
    out = networks.apply(params, observation)
    logp = jax.nn.log_softmax(out.logits)
    action = jnp.argmax(out.logits) if evaluation else jax.random.categorical(key, out.logits)
    return action, logp[action], out.value

  jitted = jax.jit(policy)
  return lambda params, key, observation: jitted(params, key, trimmed(observation))

"""The policy PPO acts with: a sample (or the argmax) of the graph network's masked logits."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from agents.networks import Networks
from environments.observations import trimmed

# policy(params, key, observation) -> (action, log_prob, value)
Policy = Callable


@functools.lru_cache(maxsize=8)
def make_policy(networks: Networks, evaluation: bool = False) -> Policy:
  """A jitted policy on one observation: sample (or argmax) a legal action. The observation's
  padding is trimmed first (one compilation per size bucket). One per network: each proposal
  (`propose`, `Auto`, an evaluation's task) asks for it again, and a new jit would compile
  again (0.25-0.3 s a bucket on 2 cores)."""

  def policy(params, key, observation):
    out = networks.apply(params, observation)
    logp = jax.nn.log_softmax(out.logits)
    action = jnp.argmax(out.logits) if evaluation else jax.random.categorical(key, out.logits)
    return action, logp[action], out.value

  jitted = jax.jit(policy)
  return lambda params, key, observation: jitted(params, key, trimmed(observation))

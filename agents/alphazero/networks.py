"""What AlphaZero's search reads from the graph network: a prior over actions and a value."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from agents.networks import Networks
from agents.search.mcts import heuristic_prior
from environments.observations import trimmed


@functools.lru_cache(maxsize=8)
def make_prior_value(networks: Networks):
  """`(params, observation) -> (probabilities, value)`, jitted on the trimmed observation,
  for search; one per network, so that each search does not compile it again."""

  def prior_value(params, observation):
    out = networks.apply(params, observation)
    return jax.nn.softmax(out.logits), out.value

  jitted = jax.jit(prior_value)
  return lambda params, observation: jitted(params, trimmed(observation))


def make_search_fns(networks: Networks, get_params: Callable[[], object],
                    prior_mix: float = 0.0):
  """`(prior_fn, value_fn)` for MCTS from the network, evaluated once per observation: the
  search asks for a leaf's prior and then for its value. `prior_mix` blends in the heuristic
  prior of plain MCTS, which keeps an untrained network's search from being blind (as
  AlphaZero's root noise keeps it exploring)."""
  prior_value = make_prior_value(networks)
  last: list = [None, None]

  def evaluate(observation):
    if last[0] is not observation:
      probs, value = prior_value(get_params(), observation)
      probs = np.asarray(probs)
      if prior_mix:
        probs = (1 - prior_mix) * probs + prior_mix * heuristic_prior(observation)
      last[:] = [observation, (probs, float(value))]
    return last[1]

  return (lambda obs: evaluate(obs)[0]), (lambda obs: evaluate(obs)[1])

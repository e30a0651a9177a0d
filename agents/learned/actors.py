"""Actors that play the learned policy.

`PolicyActor` samples from the network's masked logits (argmax when evaluating) and hands the
behaviour log-probability and parameter version to its adder. `AlphaZeroActor` searches with
MCTS at every step, the network giving the prior and the leaf values, and records the policy
the search supports at the root (its visit distribution, or the prior improved by completed
Q-values) as the policy target.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from agents.adders import Adder
from agents.core import Actor
from agents.learned.demonstrations import demonstration_moves
from agents.learned.networks import Networks
from agents.learned.variable_client import VariableClient
from agents.mcts import MCTSActor, heuristic_prior, improved_policy
from environments.observations import trimmed
from learners.alphazero import POLICY_TARGETS

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


def make_prior_value(networks: Networks):
  """`(params, observation) -> (probabilities, value)`, jitted on the trimmed observation,
  for search."""

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


class _AdderActor(Actor):
  """Passes what it sees, with the extras of its last action, to its adder."""
  _adder: Optional[Adder]
  _client: VariableClient
  _extras: dict

  def observe_first(self, timestep):
    if self._adder:
      self._adder.add_first(timestep)

  def observe(self, action, next_timestep):
    if self._adder:
      self._adder.add(action, next_timestep, self._extras)

  def update(self, wait: bool = False):
    self._client.update(wait)


class PolicyActor(_AdderActor):
  def __init__(self, policy: Policy, variable_client: VariableClient,
               adder: Optional[Adder] = None, seed: int = 0):
    self._policy = policy
    self._client = variable_client
    self._adder = adder
    self._key = jax.random.PRNGKey(seed)
    self._extras: dict = {}

  def select_action(self, observation) -> int:
    if self._client.params is None:
      self._client.update_and_wait()
    self._key, key = jax.random.split(self._key)
    action, log_prob, value = self._policy(self._client.params, key, observation)
    self._extras = {"log_prob": np.float32(log_prob),
                    "version": np.int64(self._client.version)}
    return int(action)


class AlphaZeroActor(_AdderActor):
  """MCTS with the network's prior and value at every step of `environment` (the environment
  the loop steps). The move is sampled from the root's visits; the policy target is the visit
  distribution (`policy_target="visits"`, AlphaZero's) or the prior improved by the root's
  completed Q-values (`"completed_q"`, which a search of few simulations cannot flatten). When
  the best state the search saw is the current one, the target and the move are finish.

  With `demonstrations` > 0, that share of episodes replays the best known strategy for the
  task instead (then finish), each move's target one-hot on its action: the
  learning-from-demonstrations of Acme's LfD agents, through the same replay. The best known
  strategy is the best expert's, or with `demonstration_search` > 0 a plain MCTS plan of that
  many simulations where it scores higher (searched once per task and kept). Only strategies
  that beat the starting state are demonstrated."""

  def __init__(self, environment, networks: Networks, variable_client: VariableClient,
               adder: Optional[Adder] = None, simulations: int = 16, temperature: float = 1.0,
               prior_mix: float = 0.0, evaluation: bool = False, seed: int = 0,
               demonstrations: float = 0.0, policy_target: str = "visits",
               demonstration_search: int = 0):
    if policy_target not in POLICY_TARGETS:
      raise ValueError(f"unknown policy target {policy_target!r}; "
                       f"choose from {', '.join(POLICY_TARGETS)}")
    self._env = environment
    self._target = policy_target
    self._demonstrations = demonstrations
    self._demonstration_search = demonstration_search
    self._demo: list[int] = []   # the rest of the moves of a demonstration episode
    self._known: dict = {}       # task -> its demonstration's moves
    self._client = variable_client
    self._adder = adder
    self._temperature = temperature
    self._evaluation = evaluation
    self._rng = np.random.default_rng(seed)
    prior_fn, value_fn = make_search_fns(networks, lambda: self._client.params, prior_mix)
    self._mcts = MCTSActor(environment, budget=simulations, seed=seed,
                           prior_fn=prior_fn, value_fn=value_fn)
    self._extras: dict = {}
    self.simulations = 0

  def select_action(self, observation) -> int:
    if self._client.params is None:
      self._client.update_and_wait()
    if self._demo:
      action = self._demo.pop(0)
      visits = np.zeros(observation["action_mask"].shape[0], np.float32)
      visits[action] = 1.0
      self._extras = {"visits": visits, "version": np.int64(self._client.version)}
      return action
    env = self._env.clone()
    root, best, best_score, sims = self._mcts.search(env)
    self.simulations += sims
    visits = np.zeros(observation["action_mask"].shape[0], np.float32)
    if len(root.actions) == 0 or best_score <= env.score() + 1e-12 or root.visits.sum() == 0:
      action = env.finish_action
      visits[action] = 1.0
    else:
      counts = root.visits
      visits[root.actions] = (counts / counts.sum() if self._target == "visits" else
                              improved_policy(root, self._mcts.value_fn(observation)))
      if self._evaluation or self._temperature == 0:
        action = int(root.actions[np.argmax(counts)])
      else:
        weights = counts ** (1.0 / self._temperature)
        action = int(self._rng.choice(root.actions, p=weights / weights.sum()))
    self._extras = {"visits": visits, "version": np.int64(self._client.version)}
    return int(action)

  def observe_first(self, timestep):
    self.simulations = 0
    self._demo = []
    if self._demonstrations and self._rng.random() < self._demonstrations:
      task = self._env.task
      if task not in self._known:
        self._known[task] = demonstration_moves(self._env, self._demonstration_search)
      self._demo = list(self._known[task])
    super().observe_first(timestep)

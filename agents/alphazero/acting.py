"""AlphaZero's actor: MCTS at every step, the network giving the prior and the leaf values; it
records the policy the search supports at the root (its visit distribution, or the prior
improved by completed Q-values) as the policy target."""

from __future__ import annotations

from typing import Optional

import numpy as np

from agents.actors import AdderActor
from agents.adders import Adder
from agents.alphazero.config import AlphaZeroActorConfig
from agents.alphazero.demonstrations import demonstration_moves
from agents.alphazero.networks import make_search_fns
from agents.networks import Networks
from agents.search.mcts import MCTSActor, improved_policy
from agents.variable_client import VariableClient


class AlphaZeroActor(AdderActor):
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
  that beat the starting state are demonstrated. `evaluation` plays the most visited move
  with neither the heuristic prior nor demonstrations."""

  def __init__(self, environment, networks: Networks, variable_client: VariableClient,
               adder: Optional[Adder] = None,
               config: AlphaZeroActorConfig = AlphaZeroActorConfig(),
               evaluation: bool = False, seed: int = 0):
    super().__init__(variable_client, adder)
    self.config = config = config.for_evaluation() if evaluation else config
    self._env = environment
    self._evaluation = evaluation
    self._demo: list[int] = []   # the rest of the moves of a demonstration episode
    self._known: dict = {}       # task -> its demonstration's moves
    self._rng = np.random.default_rng(seed)
    prior_fn, value_fn = make_search_fns(networks, lambda: self._client.params, config.prior_mix)
    self._mcts = MCTSActor(environment, budget=config.simulations, seed=seed,
                           prior_fn=prior_fn, value_fn=value_fn)
    self.simulations = 0

  def _record(self, visits: np.ndarray) -> None:
    self._extras = {"visits": visits, "version": np.int64(self.version)}

  def select_action(self, observation) -> int:
    self._params()
    visits = np.zeros(observation["action_mask"].shape[0], np.float32)
    if self._demo:
      action = self._demo.pop(0)
      visits[action] = 1.0
      self._record(visits)
      return action
    env = self._env.clone()
    root, best, best_score, sims = self._mcts.search(env)
    self.simulations += sims
    if len(root.actions) == 0 or best_score <= env.score() + 1e-12 or root.visits.sum() == 0:
      action = env.finish_action
      visits[action] = 1.0
    else:
      counts = root.visits
      visits[root.actions] = (counts / counts.sum() if self.config.policy_target == "visits"
                              else improved_policy(root, self._mcts.value_fn(observation)))
      if self._evaluation or self.config.temperature == 0:
        action = int(root.actions[np.argmax(counts)])
      else:
        weights = counts ** (1.0 / self.config.temperature)
        action = int(self._rng.choice(root.actions, p=weights / weights.sum()))
    self._record(visits)
    return int(action)

  def observe_first(self, timestep):
    self.simulations = 0
    self._demo = []
    if self.config.demonstrations and self._rng.random() < self.config.demonstrations:
      task = self._env.task
      if task not in self._known:
        self._known[task] = demonstration_moves(self._env, self.config.demonstration_search)
      self._demo = list(self._known[task])
    super().observe_first(timestep)

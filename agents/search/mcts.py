"""Monte-Carlo tree search over tactics with the simulator as the model (Automap / PartIR).

PUCT selection (AlphaZero's rule, with values normalised by the range seen so far, as in
MuZero) over a transposition table: states reached by different orders of the same tactics
share one node. Each simulation descends from the root to a state not yet in the table,
expands it (one environment step) and backs up the rewards along the path plus the leaf's
value. Finish is not searched over: the search remembers the best-scoring state it stepped
into and the actor plays the path to it, then finishes, because in a deterministic problem
the best state found is the answer.

`prior_fn(observation) -> probabilities over actions` and `value_fn(observation) -> float`
plug in a learned policy and value; without them the prior favours manual tactics over
single tiles (`tactic_weight`) and leaves are valued at zero.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from agents.search.planning import Plan, PlanningActor, path_to
from environments.protocols import SearchEnvironment
from environments.observations import is_manual_tactic

PriorFn = Callable[[dict], np.ndarray]
ValueFn = Callable[[dict], float]


class _Node:
  __slots__ = ("actions", "prior", "visits", "value_sum", "total", "children", "closed")

  def __init__(self, actions: np.ndarray, prior: np.ndarray):
    self.actions = actions
    self.prior = prior
    self.visits = np.zeros(len(actions))
    self.value_sum = np.zeros(len(actions))
    self.total = 0
    self.children: dict[int, int] = {}           # edge -> state key of the child
    self.closed = np.zeros(len(actions), bool)   # edges whose subtree is fully searched

  @property
  def exhausted(self) -> bool:
    return bool(self.closed.all())


def heuristic_prior(observation: dict, tactic_weight: float = 4.0) -> np.ndarray:
  """Uniform over legal actions, with manual tactics `tactic_weight` times as likely as tiles."""
  mask = observation["action_mask"].astype(np.float64)
  is_tactic = is_manual_tactic(observation["actions"])
  weights = mask * np.where(is_tactic, tactic_weight, 1.0)
  return weights / max(weights.sum(), 1e-12)


def improved_policy(node: _Node, value: float, c_visit: float = 50.0,
                    c_scale: float = 0.1) -> np.ndarray:
  """The policy the search supports at `node`, over its actions: softmax(log prior + sigma(q))
  with unvisited actions' q completed by a mix of the node's `value` and the visited actions'
  prior-weighted mean (Gumbel MuZero, Danihelka et al. 2022). Unlike visit counts it stays at
  the prior where the search learned nothing, so a few simulations do not flatten a good prior.
  """
  visited = node.visits > 0
  q = node.value_sum / np.maximum(node.visits, 1)
  n = node.visits.sum()
  if visited.any():
    p = node.prior[visited]
    mixed = (value + n * float(np.dot(p, q[visited]) / p.sum())) / (1 + n)
  else:
    mixed = value
  q = np.where(visited, q, mixed)
  spread = q.max() - q.min()
  q = (q - q.min()) / spread if spread > 0 else np.zeros_like(q)
  sigma = (c_visit + node.visits.max(initial=0)) * c_scale
  logits = np.log(np.maximum(node.prior, 1e-30)) + sigma * q
  weights = np.exp(logits - logits.max())
  return weights / weights.sum()


class MCTSActor(PlanningActor):
  """Searches `budget` simulations from the state of each episode's first decision."""

  def __init__(self, environment: SearchEnvironment, budget: int = 200, c_puct: float = 1.25,
               prior_fn: PriorFn | None = None, value_fn: ValueFn | None = None,
               tactic_weight: float = 4.0, seed: int = 0):
    super().__init__(environment)
    if budget < 1:
      raise ValueError("the MCTS budget must be at least one simulation")
    self.budget, self.c_puct = budget, c_puct
    self.prior_fn = prior_fn or (lambda obs: heuristic_prior(obs, tactic_weight))
    self.value_fn = value_fn or (lambda obs: 0.0)
    self._rng = np.random.default_rng(seed)
    self.table: dict[int, _Node] = {}

  def _expand(self, env: SearchEnvironment, observation: dict) -> _Node:
    legal = np.array([] if env.done else
                     [a for a in env.legal_actions() if a != env.finish_action], np.int64)
    prior = np.ones(len(legal))
    if len(legal):
      prior = np.asarray(self.prior_fn(observation), np.float64)[legal]
      prior = prior / prior.sum() if prior.sum() > 0 else np.full(len(legal), 1.0 / len(legal))
      prior = prior * (1 + 1e-6 * self._rng.random(len(legal)))   # random tie-breaks
    node = _Node(legal, prior)
    self.table[env.state_key] = node
    return node

  def _select(self, node: _Node, low: float, high: float) -> int:
    """PUCT over the open edges; an unvisited edge is valued at its parent's mean."""
    mean = node.value_sum / np.maximum(node.visits, 1)
    parent = node.value_sum.sum() / node.total if node.total else 0.0
    q = np.where(node.visits > 0, mean, parent)
    if high > low:
      q = (q - low) / (high - low)
    u = self.c_puct * node.prior * math.sqrt(node.total + 1) / (1 + node.visits)
    return int(np.argmax(np.where(node.closed, -np.inf, q + u)))

  def search(self, env: SearchEnvironment):
    """Runs the simulations from `env`'s state. Returns the root node (visit counts over its
    legal non-finish actions), the best-scoring state seen, its score and the simulations."""
    self.table = {}
    root = self._expand(env, env.observation())
    best, best_score = env, env.score()
    low, high = math.inf, -math.inf
    sims = 0
    while sims < self.budget and not root.exhausted:
      sims += 1
      sim = env.clone()
      path, leaf_value = [], 0.0
      node = root
      while not node.exhausted:
        k = self._select(node, low, high)
        step = sim.step(node.actions[k])
        path.append((node, k, float(step.reward)))
        score = sim.score()
        if score > best_score + 1e-12:
          best, best_score = sim.clone(), score
        key = sim.state_key
        node.children[k] = key
        child = self.table.get(key)
        if child is None:
          child = self._expand(sim, step.observation)
          leaf_value = 0.0 if sim.done else float(self.value_fn(step.observation))
          break
        node = child
      value = leaf_value
      for node, k, reward in reversed(path):
        value = reward + value
        node.visits[k] += 1
        node.value_sum[k] += value
        node.total += 1
        low, high = min(low, value), max(high, value)
        node.closed[k] = self.table[node.children[k]].exhausted
    return root, best, best_score, sims

  def plan(self, env: SearchEnvironment) -> Plan:
    start = len(env.history)
    _, best, best_score, sims = self.search(env)
    return Plan(path_to(best, start), best_score, sims, 0.0)

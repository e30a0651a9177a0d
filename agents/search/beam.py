"""Beam search over tactics: keep the `width` best states of each depth, expand each by every
legal action, stop when `patience` depths in a row find nothing better or the budget is spent."""

from __future__ import annotations

from agents.search.planning import Plan, PlanningActor, path_to
from environments.protocols import SearchEnvironment


class BeamActor(PlanningActor):

  def __init__(self, environment: SearchEnvironment, width: int = 4, budget: int = 1000,
               patience: int = 2):
    super().__init__(environment)
    if width < 1 or budget < 1 or patience < 1:
      raise ValueError("width, budget and patience must be positive")
    self.width, self.budget, self.patience = width, budget, patience

  def plan(self, env: SearchEnvironment) -> Plan:
    start = len(env.history)
    best, best_score = env, env.score()
    beam, seen, sims, stale = [env], {env.state_key}, 0, 0
    while beam and sims < self.budget and stale < self.patience:
      children = []
      for parent in beam:
        for a in parent.legal_actions():
          if a == parent.finish_action or sims >= self.budget:
            continue
          child = parent.clone()
          child.step(a)
          sims += 1
          if child.state_key not in seen:
            seen.add(child.state_key)
            children.append((child.score(), len(children), child))
      children.sort(key=lambda c: (-c[0], c[1]))
      beam = [c for _, _, c in children[: self.width] if not c.done]
      if children and children[0][0] > best_score + 1e-12:
        best_score, best, stale = children[0][0], children[0][2], 0
      else:
        stale += 1
    return Plan(path_to(best, start), best_score, sims, 0.0)

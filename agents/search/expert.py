"""The expert agent: plays the best of the corpus' expert strategies for the task."""

from __future__ import annotations

import time
from typing import NamedTuple

from agents.search.planning import Plan, PlanningActor
from environments import PartitioningEnv
from partitioner.errors import ShardzeroError, WorkloadError


class ExpertResult(NamedTuple):
  name: str
  schedule: str
  actions: tuple[int, ...]
  cost: object | None          # CostReport; None when it does not apply
  score: float | None
  fits: bool | None            # within the task's memory budget
  error: str | None = None


def evaluate_experts(env: PartitioningEnv) -> list[ExpertResult]:
  """Every expert strategy of the task's model family, played from `env`'s current state in
  a clone. Strategies with an action that is not legal are kept with the reason."""
  from corpus.experts import experts
  from partitioner.tactics import parse_schedule
  family = env.task.model.partition(":")[0]
  try:
    schedules = experts(family, env.context.mesh.names)
  except WorkloadError:
    raise WorkloadError(f"the expert agent needs a corpus model; {env.task.model!r} has no "
                        "expert strategies") from None
  out = []
  for name, schedule in schedules.items():
    trial = env.clone()
    try:
      actions = tuple(trial.action_index(str(t)) for t in parse_schedule(schedule))
      for a in actions:
        if trial.done:
          raise ShardzeroError("the episode ended before the schedule did")
        trial.step(a)
    except ShardzeroError as e:
      out.append(ExpertResult(name, schedule, (), None, None, None, str(e)))
      continue
    cost = trial.exact_cost
    out.append(ExpertResult(name, schedule, actions, cost, trial.score(),
                            cost.peak_memory_bytes <= trial.context.budget))
  return out


def best_expert(results: list[ExpertResult]) -> ExpertResult | None:
  """The fastest strategy within the budget; if none fits, the best scored."""
  ran = [r for r in results if r.cost is not None]
  fitting = [r for r in ran if r.fits]
  if fitting:
    return min(fitting, key=lambda r: r.cost.step_time_s)
  return max(ran, key=lambda r: r.score, default=None)


class ExpertActor(PlanningActor):
  """Plays the best expert strategy (by the simulator) for each episode's task."""

  def plan(self, env: PartitioningEnv) -> Plan:
    start = time.perf_counter()
    results = evaluate_experts(env)
    best = best_expert(results)
    if best is None:
      raise ShardzeroError(f"no expert strategy applies to {env.task}: "
                           + "; ".join(f"{r.name}: {r.error}" for r in results))
    sims = sum(len(r.actions) for r in results)
    return Plan(best.actions + (env.finish_action,), best.score, sims,
                time.perf_counter() - start)

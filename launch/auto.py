"""The `Auto` solver `shardzero partition` passes to the partitioner: search agents
(`agents.search.auto`), and trained policies (`policy=RUN_DIR`) played greedily or guiding
MCTS in the same sub-problem, checked against the hand schedules over the tactic's axes
(`agents.guard`): a policy's plan is applied only where no hand schedule beats it, and where
nothing fits the budget the tactic fails with the closest plan rather than apply one that
does not fit."""

from __future__ import annotations

from agents.guard import play_guarded
from agents.search import auto as search
from learners.policies import PolicyCache
from launch.runtime import collector_paused
from partitioner.errors import ScheduleError
from partitioner.tactics import AutoRequest, Tactic

POLICIES = PolicyCache()


def solve(request: AutoRequest) -> list[Tactic]:
  t = request.tactic
  if not t.policy:
    return search.solve(request)
  if t.agent not in ("greedy", "mcts"):
    raise ScheduleError(f"{t}: with a policy, agent is greedy (decoding) or mcts "
                        "(policy-guided search)")
  policy = POLICIES(t.policy)
  env = search.sub_environment(request, t.max_steps or policy.max_steps)
  with collector_paused():   # a decision of a second or two, as `propose` makes it
    guarded = play_guarded(env, policy, t.agent, t.budget)
  if not guarded.fits:
    from launch.report import human_bytes
    raise ScheduleError(
        f"{t}: no plan over {', '.join(env.context.axes)} fits the memory budget of "
        f"{human_bytes(env.context.budget)} per device; the closest, "
        f"'{env.partitioned.strategy}', needs {human_bytes(env.exact_cost.peak_memory_bytes)}")
  return search.chosen_tactics(env)

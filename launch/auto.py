"""The `Auto` solver `shardzero partition` passes to the partitioner: search agents
(`agents.search.auto`), and trained policies (`policy=RUN_DIR`) played greedily or guiding
MCTS in the same sub-problem."""

from __future__ import annotations

from agents.decoding import play_policy
from agents.search import auto as search
from learners.policies import PolicyCache
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
  play_policy(env, policy, t.agent, t.budget)
  return search.chosen_tactics(env)

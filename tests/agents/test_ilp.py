"""The ILP baseline: HiGHS over simulator-costed actions, within reach of the experts, and its
schedule replays through the partitioner."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

import partitioner as P
from agents.environment_loop import EnvironmentLoop
from agents.search.expert import best_expert, evaluate_experts
from agents.search.ilp import NEGLIGIBLE, ILPActor, _milp, _rank, _standing, solve
from agents.loggers import InMemoryLogger
from environments import PartitioningEnv, Task
from environments.tasks import data_parallel_peak, load_program
from partitioner.cost import simulate

GPT = Task("gpt:small,d_model=512,heads=8,vocab=8192,seq=256,batch=32", "batch=4,model=8")


def test_milp_takes_a_pair_only_when_together_they_pay():
  # Two actions, each worse alone (+0.1), better together (edge -0.5): take both.
  dt, dm = np.array([0.1, 0.1]), np.zeros(2)
  et = np.array([[np.nan, -0.5], [np.nan, np.nan]])
  em = np.array([[np.nan, 0.0], [np.nan, np.nan]])
  z, objective, _, status, gap, _ = _milp(dt, dm, et, em, 1.0, 5, 10)
  assert z.tolist() == [True, True] and objective == pytest.approx(-0.3) and gap == 0
  # The same pair over the (log) memory budget: neither.
  z, *_ = _milp(dt, np.array([0.6, 0.6]), et, em, 1.0, 5, 10)
  assert z.tolist() == [False, False]
  # Exclusive (the second is illegal after the first): only the better one alone.
  z, *_ = _milp(np.array([-0.2, -0.3]), dm, np.full((2, 2), np.nan), em, 1.0, 5, 10)
  assert z.tolist() == [False, True]


@pytest.mark.slow
def test_ilp_fits_a_tight_budget_near_the_expert_and_replays():
  task = dataclasses.replace(GPT, memory_budget=int(0.5 * data_parallel_peak(GPT)))
  env = PartitioningEnv(task)
  env.reset()
  expert = best_expert(evaluate_experts(env))
  actor = ILPActor(env, time_limit_s=30)
  EnvironmentLoop(env, actor, logger=InMemoryLogger()).run_episode()
  s = actor.solution
  assert "Optimal" in s.status and s.gap is not None and s.gap <= 1e-3
  assert s.variables >= len(s.actions) and s.constraints > 0 and s.simulations > s.variables
  assert env.fits and env.cost.step_time_s <= 1.10 * expert.cost.step_time_s
  # The schedule is plain tactics: it replays through the partitioner to the same cost.
  replay = P.apply(load_program(task.model), task.mesh, env.partitioned.strategy)
  assert simulate(replay, "h100").step_time_s == pytest.approx(env.cost.step_time_s)


@pytest.mark.slow
def test_further_rounds_only_ever_lower_the_step_time():
  env = PartitioningEnv(Task("mlp:small", "batch=4,model=2"))
  env.reset()
  one, three = solve(env.clone(), rounds=1), solve(env.clone(), rounds=3)
  assert one.rounds == 1 and 1 <= three.rounds <= 3
  assert three.actions[:len(one.actions)] == one.actions
  step = lambda s: _play(env, s.actions).cost.step_time_s
  assert step(three) <= step(one) + 1e-15


@pytest.mark.slow
def test_ilp_is_never_behind_a_state_it_costed():
  # Every one, two or three manual tactics (in replay order) is a state the ILP costs; its
  # plan is at least as good as the best of them, whatever the pairwise model predicted.
  # Cutting the batch (an episode's last action) is costed after plans only where they do
  # not fit, and everything fits here: alone it is a state, after others it is not tried.
  env = PartitioningEnv(Task("t5:mini", "batch=4,model=2"))
  env.reset()
  manual = [a for a in env.legal_actions()
            if a != env.finish_action and env.context.actions[a].kind != "tile"]
  tactics = [a for a in manual if env.context.actions[a].kind != "Microbatch"]
  combos = [(a,) for a in manual] + [c for k in (2, 3) for c in itertools.combinations(tactics, k)]
  best = min(_standing(s) for combo in combos if (s := _play(env, combo)) is not None)
  solution = solve(env.clone(), rounds=1)
  assert _standing(_play(env, solution.actions)) <= best
  assert solution.rounds == 1 and solution.enumerated in (0, 1)


@pytest.mark.slow
def test_on_a_folded_task_the_plan_is_chosen_on_the_whole_program():
  # The folded estimate is off by up to a few % where launches and combining count, as much
  # as plans differ: the final comparisons cost the whole program, and the plan is at least as
  # good there as every manual tactic alone.
  env = PartitioningEnv(Task("gpt:small,layers=6,batch=16", "batch=2,model=4"))
  env.reset()
  assert env.context.folding is not None
  singles = [_play(env, [a]) for a in env.legal_actions()
             if a != env.finish_action and env.context.actions[a].kind != "tile"]
  state = singles[0]
  whole = state.exact_cost
  assert whole.step_time_s != state.cost.step_time_s
  assert _standing(state, exact=True) == (whole.peak_memory_bytes > env.context.budget,
                                          round(math.log(whole.step_time_s) / NEGLIGIBLE))
  solution = solve(env.clone(), rounds=1)
  assert _standing(_play(env, solution.actions), exact=True) <= min(
      _standing(s, exact=True) for s in singles)


def test_replay_places_experts_after_the_batch_as_gshard_does():
  # The batch's layouts first, then the experts, then the rest (GShard's order); the
  # partitioner moves the experts before what split the batch over their own axis, so the
  # tokens move to them rather than their weights being gathered.
  env = PartitioningEnv(Task("moe:mini", "batch=2,model=4"))
  env.reset()
  ctx = env.context
  legal = [a for a in env.legal_actions() if a != env.finish_action]
  experts = [a for a in legal if ctx.actions[a].kind == "ExpertParallel"]
  assert len(experts) == 2
  batch = [a for a in legal if ctx.actions[a].kind == "BatchParallel" or (
      ctx.actions[a].kind == "tile" and ctx.points[ctx.actions[a].point].role == "data")]
  others = [a for a in legal if a not in experts and a not in batch]
  assert max(_rank(ctx, a) for a in batch) < min(_rank(ctx, a) for a in experts)
  assert max(_rank(ctx, a) for a in experts) < min(_rank(ctx, a) for a in others)


def _play(env, actions):
  """The state after `actions` (None where one is not legal)."""
  trial = env.clone()
  for a in actions:
    if a not in trial.legal_actions():
      return None
    trial.step(a)
  return trial

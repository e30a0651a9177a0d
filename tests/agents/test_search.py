"""Search agents in the partitioning environment: expert, random, greedy, beam, MCTS."""

import dataclasses

import numpy as np
import pytest

import partitioner as P
from agents.search.baselines import GreedyActor, RandomActor
from agents.search.beam import BeamActor
from agents.environment_loop import EnvironmentLoop
from agents.search.expert import ExpertActor, best_expert, evaluate_experts
from agents.loggers import InMemoryLogger
from agents.search.mcts import MCTSActor, _Node, improved_policy
from environments import PartitioningEnv, Task
from environments.tasks import data_parallel_peak, load_program
from partitioner.cost import simulate

# Two layers (cheap to search) at widths where communication and memory matter.
GPT = Task("gpt:small,d_model=512,heads=8,vocab=8192,seq=256,batch=32", "batch=4,model=8")


@pytest.fixture(scope="module")
def tight():
  """The GPT task with a budget that pure data parallelism violates."""
  return dataclasses.replace(GPT, memory_budget=int(0.5 * data_parallel_peak(GPT)))


def _episode(env, actor):
  log = InMemoryLogger()
  EnvironmentLoop(env, actor, logger=log).run(num_episodes=1)
  return log.data[-1]


def test_expert_plays_the_best_expert_strategy(tight):
  env = PartitioningEnv(tight)
  env.reset()
  results = evaluate_experts(env)
  best = best_expert(results)
  dp = next(r for r in results if r.name == "dp")
  assert not dp.fits and best.fits
  assert all(r.cost.step_time_s >= best.cost.step_time_s for r in results if r.fits)
  _episode(env, ExpertActor(env))
  assert env.partitioned.strategy == "; ".join(
      str(t) for t in P.parse_schedule(best.schedule))
  replay = P.apply(load_program(tight.model), tight.mesh, best.schedule)
  assert simulate(replay, "h100").step_time_s == pytest.approx(env.cost.step_time_s)


@pytest.mark.parametrize("make", [
    lambda env: MCTSActor(env, budget=150),
    lambda env: BeamActor(env, width=3, budget=400),
    lambda env: GreedyActor(env),
], ids=["mcts", "beam", "greedy"])
def test_search_matches_or_beats_the_expert_within_budget(tight, make):
  env = PartitioningEnv(tight)
  env.reset()
  expert = best_expert(evaluate_experts(env))
  actor = make(env)
  _episode(env, actor)
  assert env.cost.peak_memory_bytes <= env.context.budget
  assert env.cost.step_time_s <= expert.cost.step_time_s
  assert env.partitioned.schedule          # it chose tactics
  assert actor.simulations > 0


def test_mcts_spends_its_budget_on_new_states(tight):
  env = PartitioningEnv(tight)
  env.reset()
  actor = MCTSActor(env, budget=40)
  plan = actor.plan(env.clone())
  assert plan.simulations == 40
  assert len(actor.table) == 41          # the root and one new state per simulation
  replay = env.clone()
  for a in plan.actions:
    replay.step(a)
  assert replay.done and replay.score() == pytest.approx(plan.score)


def test_mcts_takes_a_prior_and_a_value():
  env = PartitioningEnv(Task("gpt:small", "batch=2,model=4"))
  env.reset()
  target = env.action_index("Megatron(model)")
  calls = {"prior": 0, "value": 0}

  def prior(obs):
    calls["prior"] += 1
    p = np.full(len(obs["action_mask"]), 1e-6)
    p[target] = 1.0
    return p

  def value(obs):
    calls["value"] += 1
    return 0.0

  actor = MCTSActor(env, budget=5, prior_fn=prior, value_fn=value)
  actor.plan(env.clone())
  root = actor.table[env.state_key]
  assert root.actions[np.argmax(root.visits)] == target
  assert len(actor.table) == 6   # the root and one new state per simulation
  # The prior of each but a state that ends the episode (a cut, recomputation: no actions).
  assert calls["prior"] == sum(1 for node in actor.table.values() if len(node.actions)) >= 5
  assert calls["value"] >= 4


def test_improved_policy_keeps_the_prior_until_the_search_finds_better():
  node = _Node(np.arange(3), np.array([0.6, 0.3, 0.1]))
  np.testing.assert_allclose(improved_policy(node, value=0.2), node.prior)
  # One simulation each on the first two actions: the second was worth more. Visit counts
  # would say 50/50; the improved policy moves the mass to what the search found better and
  # keeps the unvisited action near its prior.
  node.visits[:] = [1, 1, 0]
  node.value_sum[:] = [0.1, 0.5, 0.0]
  node.total = 2
  pi = improved_policy(node, value=0.2)
  assert np.isclose(pi.sum(), 1.0)
  assert pi[1] > 0.9 > pi[0]
  assert 0 < pi[2] < node.prior[2]


def test_random_actor_plays_legal_episodes():
  env = PartitioningEnv([Task("mlp:small", "batch=8"), Task("gpt:small", "batch=2,model=4")],
                        seed=0)
  loop = EnvironmentLoop(env, RandomActor(seed=0), logger=InMemoryLogger())
  steps = loop.run(num_episodes=4)
  assert steps >= 4


def test_bad_budgets_are_errors():
  env = PartitioningEnv(Task("mlp:small", "batch=8"))
  with pytest.raises(ValueError):
    MCTSActor(env, budget=0)
  with pytest.raises(ValueError):
    BeamActor(env, width=0)

"""`Microbatch(k)` as an action: it ends the episode with the plan so far replayed on the step
cut into k micro-batches (simulated whole, also where the layers are played folded; uncut
where the plan does not replay there), offered where each micro-batch holds two examples or
more, absent where the step cannot be cut; the experts and the ILP end so where their plan is
over the budget."""

import numpy as np
import pytest

import partitioner as P
from environments import PartitioningEnv, Task
from environments.observations import DYNAMIC_FEATURES, ActionColumns
from environments.tasks import load_program
from partitioner.cost import simulate

MESH = "batch=2,model=4"


def _names(env) -> list[str]:
  return [env.action_name(a) for a in env.legal_actions() if
          env.action_name(a).startswith("Microbatch(")]


@pytest.mark.parametrize("model", ["gpt:mini,batch=16", "gpt:mini,layers=6,batch=16"])
def test_a_cut_ends_the_episode_with_the_plan_replayed_on_the_cut_step(model):
  env = PartitioningEnv(Task(model, MESH, "h100"))
  env.reset()
  assert (env.context.folding is not None) == ("layers=6" in model)
  assert _names(env) == ["Microbatch(2)", "Microbatch(4)", "Microbatch(8)"]   # 16 examples
  env.step(env.action_index("BatchParallel(batch)"))
  assert _names(env) == ["Microbatch(2)", "Microbatch(4)", "Microbatch(8)"]
  env.step(env.action_index("Megatron(model)"))
  whole = env.exact_cost
  ts = env.step(env.action_index("Microbatch(4)"))
  assert ts.last() and env.done
  assert env.partitioned.strategy == "Microbatch(4); BatchParallel(batch); Megatron(model)"
  replayed = simulate(P.apply(load_program(model), MESH, env.partitioned.strategy), "h100")
  assert env.cost.step_time_s == replayed.step_time_s
  assert env.cost.peak_memory_bytes == replayed.peak_memory_bytes
  assert env.exact_cost is env.cost
  assert env.cost.peak_memory_bytes < whole.peak_memory_bytes   # a quarter of the activations
  dynamic = dict(zip(DYNAMIC_FEATURES, env.observation()["globals"][-len(DYNAMIC_FEATURES):]))
  assert dynamic["inputs_over_budget"] == pytest.approx(
      env.cost.memory.argument_bytes / env.context.budget, rel=1e-6)


def test_cut_actions_are_described_by_their_count_and_the_inputs_they_cut():
  env = PartitioningEnv(Task("gpt:mini,batch=16", MESH, "h100"))
  env.reset()
  actions = env.observation()["actions"]
  C = ActionColumns
  for k in (2, 4, 8):
    row = actions[env.action_index(f"Microbatch({k})")]
    assert row[C.MICROBATCHES] == pytest.approx(np.log2(k) / 6)
    assert row[C.ROLE + 2] == 1.0            # the bytes it cuts are the data's
  assert actions[env.action_index("Megatron(model)"), C.MICROBATCHES] == 0.0


def test_no_cut_where_the_step_needs_a_statistic_of_the_whole_batch():
  # A mixture of experts' load-balancing loss and ResNet's batch norm read batch means.
  for model in ("moe:mini", "resnet:mini"):
    env = PartitioningEnv(Task(model, MESH, "h100"))
    env.reset()
    assert not [a for a in env.context.actions if a.kind == "Microbatch"], model


def test_a_plan_that_does_not_replay_on_the_cut_step_ends_uncut():
  """A micro-batch holds two examples or more (16 into 16 is not offered). This plan (a random
  walk's) does not replay on the step cut in two: there the tiles before ZeRO reach the batch
  through the loop, and the last tile conflicts. That episode ends as finish would, uncut."""
  env = PartitioningEnv(Task("mlp:mini,batch=16", MESH, "h100"))
  env.reset()
  assert "Microbatch(16)" not in {str(a) for a in env.context.actions}
  plan = ["Tile(opt_state/0/nu/mlp/layer_2/b, 0, model)",
          "Tile(opt_state/0/mu/mlp/layer_1/w, 0, batch)", "Tile(params/mlp/layer_1/b, 0, batch)", "ZeRO(model, stage=2)", "ZeRO(batch, stage=1)",
          "Tile(batch/x, 0, model)"]
  for text in plan:
    env.step(env.action_index(text))
  with pytest.raises(P.ShardzeroError, match="cannot also shard"):
    P.apply(load_program(env.task.model), MESH, "; ".join(["Microbatch(2)"] + plan))
  before = env.cost
  ts = env.step(env.action_index("Microbatch(2)"))
  assert ts.last() and env.done and env.cost is before
  assert env.partitioned.strategy == "; ".join(plan)
  assert "does not apply" in env.context.problem(env._info, env.finish_action - 1)


@pytest.mark.parametrize("agent", ["expert", "ilp"])
def test_a_plan_over_the_budget_ends_cut_where_that_fits(agent):
  """At a budget a third under the smallest peak any hand schedule reaches (eight sequences a
  device: activations dominate), no plan of the whole batch fits; the expert's and the ILP's
  fit once cut or recomputed."""
  from agents.environment_loop import EnvironmentLoop
  from agents.loggers import InMemoryLogger
  from agents.search.expert import ExpertActor
  from agents.search.ilp import ILPActor
  from environments.tasks import smallest_expert_peak
  task = Task("gpt:mini,batch=64", MESH, "h100")
  budget = int(0.67 * smallest_expert_peak(task))
  env = PartitioningEnv(Task(task.model, MESH, "h100", budget))
  actor = ExpertActor(env) if agent == "expert" else ILPActor(env, time_limit_s=10)
  EnvironmentLoop(env, actor, logger=InMemoryLogger(), should_update=False).run_episode()
  assert env.partitioned.strategy.startswith(("Microbatch(", "Remat()"))
  assert env.fits

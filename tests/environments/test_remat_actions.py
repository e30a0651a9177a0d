"""`Remat()` as an action: it ends the episode with the plan so far replayed on the step that
recomputes its activations (simulated whole, also where the layers are played folded), offered
where the step is straight-line and does not recompute already; the experts end so where that
fits best."""

import pytest

import partitioner as P
from environments import PartitioningEnv, Task
from environments.actions import TACTIC_KINDS
from environments.observations import ActionColumns
from environments.tasks import load_program
from partitioner.cost import simulate

MESH = "batch=2,model=4"


@pytest.mark.parametrize("model", ["gpt:mini,batch=16", "gpt:mini,layers=6,batch=16"])
def test_recomputing_ends_the_episode_with_the_plan_replayed_on_the_recomputed_step(model):
  env = PartitioningEnv(Task(model, MESH, "h100"))
  env.reset()
  assert (env.context.folding is not None) == ("layers=6" in model)
  remat = env.action_index("Remat()")
  assert remat in env.legal_actions()
  env.step(env.action_index("BatchParallel(batch)"))
  env.step(env.action_index("Megatron(model)"))
  whole = env.exact_cost
  ts = env.step(remat)
  assert ts.last() and env.done
  assert env.partitioned.strategy == "Remat(); BatchParallel(batch); Megatron(model)"
  replayed = simulate(P.apply(load_program(model), MESH, env.partitioned.strategy), "h100")
  assert env.cost.step_time_s == replayed.step_time_s
  assert env.cost.peak_memory_bytes == replayed.peak_memory_bytes
  assert env.cost.peak_memory_bytes < whole.peak_memory_bytes
  assert env.cost.step_time_s > whole.step_time_s   # the forward pass computed again
  row = env.observation()["actions"][remat]
  assert row[ActionColumns.KIND].argmax() == TACTIC_KINDS.index("Remat")
  assert row[ActionColumns.ROLE + 2] == 1.0   # the inputs its activations grow with: the data


def test_offered_where_the_step_can_be_recomputed_and_only_there():
  """Not for a step written with `jax.checkpoint`; for ResNet, whose batch norm rules out
  micro-batches, yes."""
  kinds = lambda model: {a.kind for a in PartitioningEnv(Task(model, MESH, "h100")).context.actions}
  assert "Remat" not in kinds("gpt:mini,batch=16,remat=true")
  resnet = kinds("resnet:mini,batch=16")
  assert "Remat" in resnet and "Microbatch" not in resnet


def test_the_expert_ends_recomputed_where_that_fits_best():
  """One 1,024-token sequence a device in 1 GiB: no plan of the whole step fits, a cut of the
  batch repeats work (a micro-batch of 4 over 8 devices), ZeRO-3 recomputed fits."""
  from agents.environment_loop import EnvironmentLoop
  from agents.loggers import InMemoryLogger
  from agents.search.expert import ExpertActor
  env = PartitioningEnv(Task("gpt:mini,batch=8,layers=4,seq=1024", MESH, "h100", 2**30))
  EnvironmentLoop(env, ExpertActor(env), logger=InMemoryLogger(),
                  should_update=False).run_episode()
  assert env.partitioned.strategy.startswith("Remat(); ") and env.fits

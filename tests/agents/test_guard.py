"""The guard on a policy's plan (`agents.guard`): what is played is the best of the policy's
plan and the hand schedules by the one rule (fits first, then fastest), on a program of no
corpus family too; where nothing fits, the closest is played and said not to fit."""

import pytest

from agents.decoding import TrainedPolicy
from agents.guard import play_guarded
from corpus.experts import preference
from environments import EnvConfig, PartitioningEnv, Task
from environments.observations import Sizes
from learners.algorithms import make_builder

USER = "tests/partitioner/user_models.py:scanned_decoder"   # a MaxText-style decoder, no family


@pytest.fixture(scope="module")
def untrained():
  """A real policy network at its initial parameters: its plans are arbitrary."""
  builder = make_builder("alphazero", {}, Sizes(512, 1024, 128))
  networks = builder.make_networks()
  return TrainedPolicy(networks, builder.init_params(networks, seed=3), 0, 8, "untrained")


def _guarded(policy, mesh, budget=None, model=USER, search="greedy"):
  env = PartitioningEnv(Task(model, mesh, "h100", budget), config=EnvConfig(max_steps=8))
  env.reset()
  return env, play_guarded(env, policy, search, 4)


def _played(env):
  cost = env.exact_cost
  return preference(cost.step_time_s, cost.peak_memory_bytes,
                    cost.peak_memory_bytes <= env.context.budget)


def _options(g):
  """The preference of the policy's plan and of every hand schedule that applies."""
  return [preference(g.policy_step_s, g.policy_peak_bytes, g.policy_fits)] + [
      preference(h.cost.step_time_s, h.cost.peak_memory_bytes, h.fits)
      for h in g.hand if h.cost is not None]


@pytest.mark.parametrize("mesh", ["batch=4,model=2", "data=2,fsdp=2,tensor=2"])
def test_what_is_played_is_the_best_of_the_policy_and_the_hand_schedules(untrained, mesh):
  env, g = _guarded(untrained, mesh)
  assert env.done and g.best_hand is not None
  assert _played(env) == min(_options(g))
  assert g.fits and {h.name for h in g.hand} >= {"dp", "zero3", "hsdp", "dp+megatron"}
  if g.policy_won:
    assert env.partitioned.strategy == g.policy_schedule
    assert "the policy's plan is" in g.summary()
  else:
    assert env.partitioned.strategy == g.best_hand.schedule
  if mesh.count("=") == 3:   # ZeRO over the inner axes only, on a mesh of three axes
    assert "dp+megatron+zero3(fsdp)" in {h.name for h in g.hand}


def test_a_plan_over_the_budget_loses_to_a_hand_schedule_that_fits(untrained):
  _, roomy = _guarded(untrained, "batch=4,model=2")
  peaks = sorted(h.cost.peak_memory_bytes for h in roomy.hand if h.cost is not None)
  budget = int(peaks[0] * 1.001)          # only the leanest hand schedules fit
  env, g = _guarded(untrained, "batch=4,model=2", budget)
  assert g.fits and env.exact_cost.peak_memory_bytes <= budget
  assert _played(env) == min(_options(g))
  if not g.policy_fits:
    assert not g.policy_won and "over the memory budget" in g.summary()


def test_where_nothing_fits_the_closest_is_played_and_said_not_to_fit(untrained):
  env, g = _guarded(untrained, "batch=4,model=2", budget=1000)
  assert not g.fits and not g.policy_fits
  peak = env.exact_cost.peak_memory_bytes
  assert peak == min([g.policy_peak_bytes] + [h.cost.peak_memory_bytes for h in g.hand
                                              if h.cost is not None])
  assert peak > 1000


def test_policy_guided_search_is_guarded_too(untrained):
  env, g = _guarded(untrained, "batch=4,model=2", model="mlp:mini", search="mcts")
  assert g.simulations == 4
  assert _played(env) == min(_options(g))


def test_micro_batches_try_only_the_plans_that_do_not_fit_and_beat_the_answer(untrained):
  """gpt:mini at batch 64 in 2.5 GiB per device: no whole-batch plan fits (the policy's line
  is cut where it is over the budget, `agents.decoding`), the fastest hand schedules fit once
  their batch is cut or their activations recomputed (ZeRO-2 recomputed is the faster), and a
  plan rewritten so is kept only where it beats `faster_than`."""
  from agents.guard import fit_with_microbatches
  env, g = _guarded(untrained, "batch=2,model=4", budget=int(2.5 * 2**30),
                    model="gpt:mini,batch=64")
  assert not any(h.fits for h in g.hand if h.cost is not None)
  assert not g.policy_fits or g.policy_schedule.startswith(("Microbatch(", "Remat()"))
  cut = fit_with_microbatches(env.context, g, faster_than=float("inf"))
  assert cut is not None and cut.pp.program.microbatches == cut.k
  assert cut.cost.peak_memory_bytes <= env.context.budget
  assert str(cut.pp.schedule[0]) in ("Remat()", f"Microbatch({cut.k})")
  assert fit_with_microbatches(env.context, g, faster_than=cut.cost.step_time_s) is None


def test_plans_over_the_budget_are_tried_with_their_activations_recomputed(untrained):
  """gpt:mini of 4 layers at one 1,024-token sequence a device in 1 GiB: ZeRO-3 needs 1.46
  GiB whole, and cutting the batch only repeats work (a micro-batch of 4 sequences over 8
  devices: 3.8 GiB under data parallelism); with its activations recomputed it needs 0.67."""
  from agents.guard import fit_with_microbatches
  env, g = _guarded(untrained, "batch=2,model=4", budget=2**30,
                    model="gpt:mini,batch=8,layers=4,seq=1024")
  found = fit_with_microbatches(env.context, g, faster_than=float("inf"))
  assert found is not None and str(found.pp.schedule[0]) == "Remat()"
  assert found.cost.peak_memory_bytes <= env.context.budget
  assert found.pp.program.recomputation is not None or found.k > 1


def test_micro_batch_counts_that_cannot_fit_are_not_traced():
  """Counts come from the peak's inputs (which cutting leaves whole) and, after a count that
  did not fit, from the peak through both measurements: none where what does not shrink is
  over the budget."""
  from agents.guard import _first_count, _next_count
  gib = 2**30
  assert _first_count(100 * gib, 90 * gib, 80 * gib) is None       # the inputs alone
  assert _first_count(120 * gib, 40 * gib, 80 * gib) == 2          # the rest, halved, fits
  assert _first_count(200 * gib, 40 * gib, 80 * gib) == 4
  assert _next_count(84 * gib, 2, 97 * gib, 80 * gib) is None      # cutting grew the peak
  assert _next_count(120 * gib, 2, 110 * gib, 80 * gib) is None    # 100 GiB does not shrink
  assert _next_count(120 * gib, 2, 90 * gib, 80 * gib) == 4        # 60 + 60/k: k >= 3


def test_megatron_plans_are_tried_again_with_their_attention_heads_padded():
  """gpt:mini with 6 heads over 4 devices: Megatron leaves the attention whole on each; after
  `HeadPadding(model)` it splits 8 heads two to a device, and the plan is faster. The guard
  (`with_heads_padded`) and the expert agent's evaluation (`heads_padded_plan`) find it."""
  from agents.guard import with_heads_padded
  from environments.tasks import load_program
  from launch.evaluation import AgentSpec, heads_padded_plan
  from partitioner import apply
  from partitioner.cost import simulate
  env = PartitioningEnv(Task("gpt:mini,heads=6,d_model=768", "batch=2,model=4", "h100"),
                        config=EnvConfig(max_steps=8))
  env.reset()
  ctx = env.context
  program = load_program(ctx.task.model)
  megatron = "BatchParallel(batch); Megatron(model)"
  plans = [("dp+megatron", megatron), ("zero3", "BatchParallel(batch); ZeRO(batch, stage=3)")]
  whole = simulate(apply(program, ctx.mesh, megatron), "h100").step_time_s
  found = with_heads_padded(program, ctx, plans, float("inf"))
  assert found.k == 1 and found.base == "dp+megatron"
  assert [str(t) for t in found.pp.schedule] == ["HeadPadding(model)", "BatchParallel(batch)",
                                                 "Megatron(model)"]
  assert found.cost.step_time_s < whole
  assert with_heads_padded(program, ctx, plans, found.cost.step_time_s) is None
  row = heads_padded_plan(AgentSpec("expert"), env)   # not played yet: anything beats no plan
  assert row["schedule"].startswith("HeadPadding(model); ") and row["fits"]
  # A search agent decides every axis of the padded program itself, as it does a pipeline's.
  row = heads_padded_plan(AgentSpec("greedy"), env)
  assert row["schedule"].startswith("HeadPadding(model); ") and row["fits"]


def test_no_padded_plan_beats_its_even_share_and_none_is_tried_that_cannot(monkeypatch):
  """Every plan of gpt:mini's heads padded over `model` (split, unsplit, cut, recomputed)
  takes at least the padded step's computation shared by the 8 devices (`even_share_s`);
  where the plan to beat is no slower than that, the guard and the evaluation's agents pad
  nothing (HF Llama 1B's 32 heads over 128 nodes: 60 of the ILP's 103 s went there)."""
  from agents.guard import with_heads_padded
  from agents.pipelines import even_share_s
  from environments.tasks import load_program
  from launch.evaluation import AgentSpec, heads_padded_plan
  from partitioner import apply, partition
  from partitioner.cost import simulate
  from partitioner.heads import pad_heads
  env = PartitioningEnv(Task("gpt:mini,heads=6,d_model=768", "batch=2,model=4", "h100"),
                        config=EnvConfig(max_steps=8))
  env.reset()
  ctx = env.context
  program = load_program(ctx.task.model)
  share = even_share_s(pad_heads(program, 4), ctx.mesh, "h100")
  assert share > even_share_s(program, ctx.mesh, "h100")      # padding adds work
  megatron = "BatchParallel(batch); Megatron(model)"
  for plan in (megatron, "BatchParallel(batch); ZeRO(batch, stage=3)",
               "Microbatch(2); " + megatron, "Remat(); " + megatron, ""):
    step = simulate(apply(program, ctx.mesh, "HeadPadding(model); " + plan), "h100").step_time_s
    assert step >= share, plan
  monkeypatch.setattr(partition.PartitionedProgram, "apply",
                      lambda *a, **k: pytest.fail("a padded program was partitioned"))
  assert with_heads_padded(program, ctx, [("dp+megatron", megatron)], share) is None
  for agent in ("expert", "greedy"):
    assert heads_padded_plan(AgentSpec(agent), env, {"fits": True, "step_time_s": share}) is None


def test_a_padded_plan_over_the_budget_is_cut_into_micro_batches():
  from agents.guard import with_heads_padded
  from environments.tasks import load_program
  from partitioner import apply
  from partitioner.cost import simulate
  model, mesh = "gpt:mini,heads=6,d_model=768", "batch=2,model=4"
  program = load_program(model)
  megatron = "BatchParallel(batch); Megatron(model)"
  whole = simulate(apply(program, mesh, "HeadPadding(model); " + megatron), "h100")
  budget = int(whole.memory.argument_bytes + 0.5 * (whole.peak_memory_bytes -
                                                    whole.memory.argument_bytes))
  env = PartitioningEnv(Task(model, mesh, "h100", budget), config=EnvConfig(max_steps=8))
  found = with_heads_padded(program, env.context, [("dp+megatron", megatron)], float("inf"))
  assert found.k >= 2 and found.cost.peak_memory_bytes <= budget
  assert [str(t) for t in found.pp.schedule][:2] == ["HeadPadding(model)", f"Microbatch({found.k})"]


def test_a_search_agents_padded_plan_over_the_budget_is_cut_into_micro_batches():
  """Greedy deciding the padded gpt:mini at a budget a fifth of the way from its inputs to
  dp+Megatron's peak ends over it (ZeRO over both axes, 1.40 GB of 1.14); its decisions again
  with the batch cut in two fit, and that is the row's plan."""
  from environments.tasks import load_program
  from launch.evaluation import AgentSpec, heads_padded_plan
  from partitioner import apply
  from partitioner.cost import simulate
  model, mesh = "gpt:mini,heads=6,d_model=768", "batch=2,model=4"
  whole = simulate(apply(load_program(model), mesh,
                         "HeadPadding(model); BatchParallel(batch); Megatron(model)"), "h100")
  budget = int(whole.memory.argument_bytes + 0.2 * (whole.peak_memory_bytes -
                                                    whole.memory.argument_bytes))
  env = PartitioningEnv(Task(model, mesh, "h100", budget), config=EnvConfig(max_steps=8))
  env.reset()
  row = heads_padded_plan(AgentSpec("greedy"), env)
  assert row["fits"] and row["peak_memory_bytes"] <= budget
  assert row["schedule"].startswith("HeadPadding(model); Microbatch(")

"""The partitioning environment: dm-env conformance, reward, masks, clones, reproducibility."""

import dataclasses

import dm_env
import numpy as np
import pytest
from absl.testing import absltest
from dm_env import test_utils

import partitioner as P
from agents.search.expert import evaluate_experts
from environments import (InvalidActionError, PartitioningEnv, Task, TaskDistribution,
                          decision_points, parse_bytes, task_context)
from environments.actions import ENDINGS
from environments.tasks import data_parallel_peak, load_program, smallest_expert_peak
from partitioner.cost import simulate
from partitioner.errors import ShardzeroError, WorkloadError
from partitioner.tactics import Tile

GPT = Task("gpt:small", "batch=2,model=4")


def _dynamic(observation) -> dict:
  from environments.observations import DYNAMIC_FEATURES
  return dict(zip(DYNAMIC_FEATURES, observation["globals"][-len(DYNAMIC_FEATURES):]))
MLP = Task("mlp:small", "batch=8")


class _Conformance(test_utils.EnvironmentTestMixin):
  task = GPT

  def make_object_under_test(self):
    self._rng = np.random.default_rng(0)
    return PartitioningEnv(self.task, seed=1)

  def make_action(self):
    env = self.environment
    if env._info is None or env.done:
      return 0
    return int(self._rng.choice(env.legal_actions()))

  def make_action_sequence(self):
    for _ in range(6):
      yield self.make_action()
    yield self.environment.finish_action


class GPTConformanceTest(_Conformance, absltest.TestCase):
  task = GPT


class MLPConformanceTest(_Conformance, absltest.TestCase):
  task = MLP


class BudgetConformanceTest(_Conformance, absltest.TestCase):
  task = dataclasses.replace(GPT, memory_budget=1)


def _run(env, actions):
  steps = [env.step(a) for a in actions]
  return steps


def test_return_is_improvement_minus_penalties():
  env = PartitioningEnv(dataclasses.replace(GPT, memory_budget=parse_bytes("600KiB")))
  env.reset()
  c0 = env.cost.step_time_s
  total, penalties = 0.0, 0.0
  for text in ["BatchParallel(batch)", "Megatron(model)", "ZeRO(batch)", "Finish"]:
    ts = env.step(env.action_index(text))
    total += ts.reward
    penalties += env.penalty()
  assert ts.last() and ts.step_type == dm_env.StepType.LAST and ts.discount == 0.0
  assert penalties > 0   # some states were over this budget
  assert total == pytest.approx((c0 - env.cost.step_time_s) / c0 - penalties, rel=1e-9, abs=1e-9)
  # The state is what the partitioner gives for the same schedule.
  pp = P.apply(load_program(GPT.model), GPT.mesh, env.partitioned.strategy)
  assert simulate(pp, "h100").step_time_s == pytest.approx(env.cost.step_time_s)


def test_penalty_only_over_budget():
  big = PartitioningEnv(GPT)
  big.reset()
  assert big.penalty() == 0.0
  tight = PartitioningEnv(dataclasses.replace(GPT, memory_budget=1))
  tight.reset()
  assert tight.penalty() > 1.0
  assert _dynamic(tight.observation())["fits"] == 0.0
  assert _dynamic(big.observation())["fits"] == 1.0


def test_budgets_of_one_task_share_its_states():
  tight_task = dataclasses.replace(GPT, memory_budget=parse_bytes("600KiB"))
  full, tight = task_context(GPT), task_context(tight_task)
  assert tight.task == tight_task and tight.budget == tight_task.memory_budget
  assert full.budget == full.hardware.hbm_bytes
  assert tight.root is full.root and tight.graph is full.graph
  big, small = PartitioningEnv(full), PartitioningEnv(tight)
  for env in (big, small):
    env.reset()
    ts = env.step(env.action_index("BatchParallel(batch)"))
  assert small.cost is big.cost                  # simulated once
  assert small.penalty() > 0 == big.penalty()
  assert ts.reward == pytest.approx(-small.penalty() + (small.context.root.cost.step_time_s -
                                                       small.cost.step_time_s) /
                                    small.context.root.cost.step_time_s)
  assert _dynamic(ts.observation)["fits"] == 0.0 and _dynamic(big.observation())["fits"] == 1.0
  with pytest.raises(ShardzeroError, match="not .* at another budget"):
    full.with_budget(MLP)


def test_masked_and_bad_actions_are_errors_and_change_nothing():
  env = PartitioningEnv(GPT)
  env.reset()
  bp = env.action_index("BatchParallel(batch)")
  env.step(bp)
  before = (env.history, env.state_key)
  with pytest.raises(InvalidActionError, match="applied already"):
    env.step(bp)
  tile = env.action_index("Tile(batch/inputs, 1, batch)")
  with pytest.raises(InvalidActionError, match="already sharded over 'batch'"):
    env.step(tile)
  with pytest.raises(InvalidActionError, match="out of range"):
    env.step(10_000)
  with pytest.raises(InvalidActionError, match="one integer"):
    env.step("Megatron")
  with pytest.raises(InvalidActionError, match="not an action"):
    env.action_index("Megatron(nope)")
  assert (env.history, env.state_key) == before
  mask = env.observation()["action_mask"]
  assert not mask[bp] and not mask[tile] and mask[env.finish_action]
  assert not mask[len(env.context.actions):].any()   # padding is never legal


def test_mask_matches_what_applying_does():
  """Every legal action applies; a masked one fails, changes nothing, or was applied."""
  env = PartitioningEnv(GPT)
  env.reset()
  env.step(env.action_index("SequenceParallel(model)"))
  legal = set(env.legal_actions().tolist())
  ctx = env.context
  for i, action in enumerate(ctx.actions):
    if action.tactic is None:
      continue
    try:
      if action.kind == "Microbatch":   # it rewrites the program: first in the schedule
        new = P.apply(ctx.program, GPT.mesh, (action.tactic,) + env.partitioned.schedule)
        ok = new.program.microbatches == action.tactic.k
      elif action.kind == "Remat":
        new = P.apply(ctx.program, GPT.mesh, (action.tactic,) + env.partitioned.schedule)
        ok = new.program.recomputation is not None
      else:
        new = env.partitioned.apply(action.tactic)
        ok = new.state.dims != env.partitioned.state.dims
    except P.ShardzeroError:
      ok = False
    if i in legal:
      assert ok, action
    elif action.kind != "ZeRO" and str(action) != "SequenceParallel(model)":
      assert not ok, (action, ctx.problem(env._info, i))


@pytest.mark.parametrize("task", [GPT, Task("moe:small", "batch=2,model=4")], ids=str)
def test_masks_and_keys_updated_from_the_previous_state_equal_those_made_afresh(task):
  """Each state's mask is its parent's with the tiles and manual tactics whose values changed
  re-checked, and its key its parent's with the changed values rehashed."""
  env = PartitioningEnv(task, seed=3)
  rng = np.random.default_rng(3)
  ctx, checked = env.context, 0
  assert ("ExpertParallel(model)" if "moe" in task.model else "Megatron(model)") in ctx.index
  zero = env.action_index("ZeRO(batch, stage=1)")   # forbids axes: every tile is re-checked
  for episode in range(6):
    ts = env.reset()
    if episode % 2:
      ts = env.step(zero)
    while not ts.last():
      ts = env.step(int(rng.choice(env.legal_actions())))
      if env.partitioned.program is not ctx.program:   # cut into micro-batches: the last state
        continue
      fresh = ctx._make(env.partitioned, None)
      np.testing.assert_array_equal(env._info.mask, fresh.mask)
      np.testing.assert_array_equal(env._info.sharding, fresh.sharding)
      assert env._info.key == fresh.key
      state = env.partitioned.state   # decided: a decision point's member a tactic tiled itself
      direct = {v for (v, _), o in state.origin.items() if o.op is None}
      np.testing.assert_array_equal(env._info.sharding[:, -1] == 1,
                                    [v in ctx._members and v in direct
                                     for v in range(len(state.dims))])
      checked += 1
  assert checked >= 8


def test_a_state_replayed_for_expert_parallelism_has_its_mask_made_afresh():
  """`ExpertParallel(model)` after `BatchParallel(model)` replays the plan with the experts
  placed first (a new lineage). The mask must see that the experts are split over `model`
  now: with 4 experts, `ExpertParallel(batch)` no longer divides (session 59: a stale mask
  offered it, MCTS played it, and the replay raised inside an evaluation)."""
  env = PartitioningEnv(Task("moe:small,experts=4", "batch=2,model=4"))
  env.reset()
  ctx = env.context
  ep_batch = env.action_index("ExpertParallel(batch)")
  assert ep_batch in env.legal_actions()
  for name in ("BatchParallel(batch)", "BatchParallel(model)", "ExpertParallel(model)"):
    env.step(env.action_index(name))
  assert [str(t) for t in env.partitioned.schedule] == [
      "BatchParallel(batch)", "ExpertParallel(model)", "BatchParallel(model)"]
  np.testing.assert_array_equal(env._info.mask, ctx._make(env.partitioned, None).mask)
  assert ep_batch not in env.legal_actions()
  assert "split 4 ways over model already" in ctx.problem(env._info, ep_batch)


def test_keys_are_equal_exactly_for_equal_states():
  """Search merges states by key, so two different states must never share one: ResNet's
  parameters of one shape, tiled alike, differ only in which value carries the tile."""
  ctx = PartitioningEnv(Task("resnet:mini", "batch=2,model=4")).context
  states: dict[int, tuple] = {}
  for i in np.flatnonzero(ctx.root.mask):
    if i != ctx.finish and ctx.actions[i].kind not in ENDINGS:   # those rewrite the program
      info = ctx._make(ctx.root.pp.apply(ctx.actions[i].tactic), ctx.root)
      state = info.pp.state
      same = (tuple(state.dims), sorted(state.forbidden.items()),
              sorted(str(t) for t in info.pp.schedule if not isinstance(t, Tile)))
      assert states.setdefault(info.key, same) == same, ctx.actions[i]
  assert len(states) > 50


def test_decision_points_group_layers_and_replay():
  program = load_program(GPT.model)
  points = {p.pattern: p for p in decision_points(program)}
  q = points["params/gpt/layer_*/attn/query/w"]
  assert len(q.members) == 2 and q.role == "param"
  opt = points["opt_state/**/gpt/layer_*/attn/query/w"]
  assert len(opt.members) == 4 and opt.role == "opt"   # mu and nu of both layers
  for p in points.values():
    assert set(program.match(p.pattern)) == set(p.members)
  env = PartitioningEnv(GPT)
  env.reset()
  env.step(env.action_index("Tile(params/gpt/layer_*/attn/query/w, 1, model)"))
  replay = P.apply(program, GPT.mesh, env.partitioned.strategy)
  assert replay.state.dims == env.partitioned.state.dims
  assert replay.sharding("params/gpt/layer_1/attn/query/w").dims == ((), ("model",))


def test_observation_shapes_and_sharding_features():
  env = PartitioningEnv(GPT)
  spec = env.observation_spec()
  ts = env.reset()
  for k, s in spec.items():
    s.validate(ts.observation[k])
  obs0 = ts.observation
  assert obs0["action_mask"].sum() == len(env.legal_actions())
  assert obs0["node_sharding"].sum() == 0
  ts = env.step(env.action_index("BatchParallel(batch)"))
  sharded = ts.observation["node_sharding"]
  tokens = env.context.program.value("batch/inputs").id
  assert sharded[tokens, 0 * 4 + 0] == 1 and sharded[tokens, -1] == 1   # dim 0 on batch, decided
  assert sharded.sum() > 100          # propagation reached many values
  assert obs0["node_sharding"].sum() == 0   # earlier observations are not mutated



def test_actions_name_the_values_they_tile_and_globals_what_is_sharded():
  """A manual tactic's row points at its footprint (Megatron: weights, BatchParallel: the batch,
  ZeRO: optimizer state and batch) with its bytes by role; the globals give per role and axis the share of
  bytes sharded, which moves from 0 to 1 for the data when the batch is split."""
  from environments.actions import ROLES
  from environments.observations import (MAX_AXES, MESH_FEATURES, PROGRAM_FEATURES, TOUCHED,
                                         ActionColumns)
  env = PartitioningEnv(Task("gpt:mini", "batch=4,model=2"))
  obs = env.reset().observation
  program = env.context.program
  role_share = ActionColumns.ROLE

  def touched(name):
    i = env.action_index(name)
    return ([program.name(v) for v in obs["action_nodes"][i][obs["action_nodes_mask"][i]]],
            obs["actions"][i, role_share:role_share + len(ROLES)])
  names, share = touched("Megatron(model)")
  assert names and all(n.startswith("params/") for n in names) and share[0] == 1.0
  names, share = touched("BatchParallel(batch)")
  assert names and all(n.startswith("batch/") for n in names) and share[2] == 1.0
  names, share = touched("ZeRO(batch, stage=1)")     # data parallel, optimizer state split
  assert len(names) == TOUCHED and {n.split("/")[0] for n in names} == {"opt_state", "batch"}
  assert share[1] > 0.99 and 0 < share[2] < 0.01
  names, _ = touched("Tile(params/gpt/layer_*/w_in/w, 1, model)")
  assert names == ["params/gpt/layer_0/w_in/w", "params/gpt/layer_1/w_in/w"]
  assert not obs["action_nodes_mask"][env.finish_action].any()

  start = MESH_FEATURES + PROGRAM_FEATURES
  shared = lambda o: o["globals"][start:start + len(ROLES) * MAX_AXES].reshape(len(ROLES),
                                                                                MAX_AXES)
  assert shared(obs).sum() == 0
  slot = env.context.graph.axis_index       # model (2) before batch (4): by where they land
  assert (slot["model"], slot["batch"]) == (0, 1)
  after = shared(env.step(env.action_index("BatchParallel(batch)")).observation)
  assert after[ROLES.index("data"), slot["batch"]] == 1.0   # all of the batch over `batch`
  assert after[ROLES.index("param")].sum() == 0        # no parameter is split
  after = shared(env.step(env.action_index("Megatron(model)")).observation)
  assert 0 < after[ROLES.index("param"), slot["model"]] < 1   # some parameters over `model`

def test_program_features_tell_model_families_apart():
  """The globals say what kind of model it is: convolution FLOPs, attention (batched) matmuls."""
  from environments.observations import MESH_FEATURES, program_features
  from partitioner import roles
  from partitioner.cost.compute import op_work

  def features(model):
    program = load_program(model)
    return program_features(program, op_work(program), roles.roles(program))
  conv, attention, mlp = features("resnet:mini"), features("gpt:mini"), features("mlp:mini")
  assert conv[5] > 0.9 and attention[5] == mlp[5] == 0              # conv share of FLOPs
  assert attention[4] > 0.9 and mlp[4] > 0.9 and conv[4] < 0.1      # matmul share of FLOPs
  assert attention[7] > 0.1 and mlp[7] == conv[7] == 0              # batched (attention) matmuls
  # FLOPs per parameter byte: a quarter of the batch, two fewer bits of compute per byte.
  np.testing.assert_allclose(attention[12] - features("gpt:mini,batch=8")[12], 2 / 20, atol=0.01)
  ts = PartitioningEnv(Task("resnet:mini", "batch=4,model=2")).reset()
  np.testing.assert_allclose(ts.observation["globals"][MESH_FEATURES:MESH_FEATURES + len(conv)],
                             conv)


def test_clone_is_exact_and_independent():
  env = PartitioningEnv(GPT)
  env.reset()
  env.step(env.action_index("BatchParallel(batch)"))
  twin = env.clone()
  a = env.action_index("Megatron(model)")
  r1 = env.step(a)
  assert twin.history == (env.history[0],)
  r2 = twin.step(a)
  assert r1.reward == r2.reward and env.state_key == twin.state_key
  for k in r1.observation:
    np.testing.assert_array_equal(r1.observation[k], r2.observation[k])
  twin.step(twin.finish_action)
  assert twin.done and not env.done


def test_transpositions_share_a_key():
  env = PartitioningEnv(GPT)
  env.reset()
  a = env.action_index("Tile(params/gpt/layer_*/w_in/w, 1, model)")
  b = env.action_index("Tile(batch/inputs, 0, batch)")
  one, two = env.clone(), env.clone()
  _run(one, [a, b])
  _run(two, [b, a])
  assert one.state_key == two.state_key
  assert one.cost.step_time_s == pytest.approx(two.cost.step_time_s)


def test_episode_ends_at_the_step_limit():
  from environments import EnvConfig
  env = PartitioningEnv(GPT, config=EnvConfig(max_steps=2))
  env.reset()
  ts = env.step(env.action_index("BatchParallel(batch)"))
  assert ts.mid()
  ts = env.step(env.action_index("Megatron(model)"))
  assert ts.last() and ts.discount == 1.0   # truncation
  assert env.step(0).first()               # the next step starts a new episode


def test_seeded_episodes_reproduce():
  dist = TaskDistribution(("gpt:small", "mlp:small"), meshes=("batch=8", "batch=2,model=4"),
                          budget_fractions=(None, 0.5))

  def episodes(seed):
    env, rng, out = PartitioningEnv(dist, seed=seed), np.random.default_rng(seed), []
    for _ in range(3):
      ts, total = env.reset(), 0.0
      while not ts.last():
        ts = env.step(rng.choice(env.legal_actions()))
        total += ts.reward
      out.append((str(env.task), env.history, total))
    return out

  first = episodes(3)
  assert first == episodes(3)
  assert len({t for t, _, _ in first + episodes(4)}) > 1


def test_task_distribution_from_split_and_budgets():
  dist = TaskDistribution.from_split("heldout", budget_fractions=(0.5,))
  assert {m.split(":")[0] for m in dist.models} == {"t5", "moe", "unet", "ssm"}
  # Half of the data-parallel peak fits no expert strategy of gpt:mini (activations dominate);
  # a tight budget lies halfway between the smallest expert peak and the data-parallel one.
  task = Task("gpt:mini", "batch=4,model=2")
  tight = TaskDistribution(("gpt:mini",), meshes=(task.mesh,), budget_fractions=(0.5,))
  sampled = tight.sample(np.random.default_rng(0))
  low, high = smallest_expert_peak(task), data_parallel_peak(task)
  assert 0.5 * high < low < high
  assert sampled.memory_budget == int(low + 0.5 * (high - low))
  env = PartitioningEnv(sampled)
  env.reset()
  assert not env.fits and env.cost.peak_memory_bytes > sampled.memory_budget
  results = evaluate_experts(env)
  assert all(r.fits == (r.cost.peak_memory_bytes <= sampled.memory_budget)
             for r in results if r.cost is not None)
  assert not next(r for r in results if r.name == "dp").fits
  assert any(r.fits for r in results)
  assert tight.tasks() == [sampled]
  # Below 0, toward nothing from the smallest expert peak: no whole-batch plan fits.
  under = TaskDistribution(("gpt:mini",), meshes=(task.mesh,), budget_fractions=(-0.2,))
  assert under.tasks()[0].memory_budget == int(0.8 * low)
  with pytest.raises(WorkloadError, match="split"):
    TaskDistribution.from_split("test")
  for bad in (0.0, -1.0, -2.0):
    with pytest.raises(WorkloadError, match="above -1"):
      TaskDistribution(("mlp:small",), budget_fractions=(bad,))


def test_weak_scaled_distributions_grow_the_batch_with_the_mesh(tmp_path):
  """Training with `batch_per_device` pairs each model with a batch of that many examples per
  device of its mesh, as `shardzero evaluate --batch-per-device` does; the run's evaluation
  tasks follow."""
  from learners.run_config import RunConfig
  dist = TaskDistribution(("gpt:mini", "mlp:mini,batch=4096"),
                          meshes=("batch=4,model=2", "batch=16,model=4"),
                          budget_fractions=(None,), batch_per_device=2)
  assert [t.model for t in dist.tasks()] == [
      "gpt:mini,batch=16", "gpt:mini,batch=128", "mlp:mini,batch=4096,batch=16",
      "mlp:mini,batch=4096,batch=128"]
  import corpus
  assert corpus.parse(dist.tasks()[3].model)[1].batch == 128    # the last batch knob wins
  with pytest.raises(WorkloadError, match="positive"):
    TaskDistribution(("mlp:small",), batch_per_device=0)
  config = RunConfig(models=("gpt:mini",), heldout=("t5:mini",), meshes=dist.meshes,
                     eval_mesh="batch=4,model=2", batch_per_device=2)
  assert config.train_tasks().sample(np.random.default_rng(0)).model.startswith("gpt:mini,batch=")
  assert [t.model for t in config.heldout_tasks()] == ["t5:mini,batch=16"]
  assert [t.model for t in config.train_eval_tasks()] == ["gpt:mini,batch=16"]
  # Several counts: every task at each, drawn alike; evaluation at the first.
  both = dataclasses.replace(dist, batch_per_device=(2, 1))
  assert [t.model for t in both.tasks()][:2] == ["gpt:mini,batch=16", "gpt:mini,batch=8"]
  assert len(both.tasks()) == 8
  drawn = {both.sample(np.random.default_rng(s)).model for s in range(40)}
  assert {"gpt:mini,batch=8", "gpt:mini,batch=16", "gpt:mini,batch=64"} <= drawn
  with pytest.raises(WorkloadError, match="positive"):
    TaskDistribution(("mlp:small",), batch_per_device=(2, 0))
  config = dataclasses.replace(config, batch_per_device=(2, 1))
  assert [t.model for t in config.heldout_tasks()] == ["t5:mini,batch=16"]
  config.save(str(tmp_path))
  assert RunConfig.load(str(tmp_path)) == config


def test_train_variants_demonstrate_more_strategy_families():
  import corpus
  from agents.search.expert import best_expert
  models = corpus.train_models("mini")
  assert models[:len(corpus.split("train"))] == [f"{n}:mini" for n in corpus.split("train")]
  best = {}
  for model in ("gpt:mini", "gpt:mini,batch=4", "resnet:mini", "resnet:mini,batch=1024"):
    assert model in models
    env = PartitioningEnv(Task(model, "batch=4,model=2"))
    env.reset()
    best[model] = best_expert(evaluate_experts(env))
  # ZeRO-2 over all eight GPUs of the node; at 4 sequences Megatron over the 4-way axis,
  # embeddings split too; the convolutions data parallel.
  assert best["gpt:mini"].name == "zero2"
  assert best["gpt:mini,batch=4"].name == "dp+megatron+vocab[batch]"
  assert best["resnet:mini"].name == "dp"
  assert 0 < best["resnet:mini"].score < best["resnet:mini,batch=1024"].score   # more per byte
  assert len({b.name for b in best.values()}) == 3


def test_parse_bytes():
  assert parse_bytes("16GiB") == 16 * 2**30
  assert parse_bytes("1.5MiB") == int(1.5 * 2**20)
  assert parse_bytes("2e9") == 2_000_000_000
  for bad in ("lots", "12 parsecs", "-3GiB", "0"):
    with pytest.raises(WorkloadError):
      parse_bytes(bad)


def test_unknown_model_is_a_clear_error():
  with pytest.raises(WorkloadError, match="neither a corpus family"):
    PartitioningEnv(Task("gtp:small", "batch=2"))

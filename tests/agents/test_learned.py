"""The learned policy: the graph network, Reverb adders on a real server, learners that lower
their loss, checkpoints that survive and refuse damage."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import reverb
import tree

from agents.environment_loop import EnvironmentLoop
from agents.search.expert import best_expert, evaluate_experts
from agents.alphazero.networks import make_prior_value
from agents.ppo.networks import make_policy
from learners.algorithms import make_builder
from learners.run_config import RunConfig
from agents.networks import MASKED, make_networks
from agents.variable_client import (LearnerVariableSource, ReverbVariableSource,
                                            VariableClient, publish)
from agents.loggers import InMemoryLogger
from environments import EnvConfig, PartitioningEnv, Task
from environments.observations import Sizes, trimmed
from learners import checkpointing
from partitioner.errors import ShardzeroError

SIZES = Sizes(256, 512, 128)
TASK = Task("mlp:mini", "batch=4,model=2")
# A task where a plain search beats every expert: an MLP at batch 1024 on batch=8,model=2 wants
# Megatron over batch and ZeRO-2 over model, where the best expert is Megatron over both.
SEARCH_WINS = Task("mlp:mini,batch=64", "batch=8,model=2")


class _Fixed:
  """A variable source serving fixed parameters at a given version."""

  def __init__(self, params, version=7):
    self.params, self.version = params, version

  def get_variables(self, names):
    return [(self.params, self.version) for _ in names]


@pytest.fixture(scope="module")
def env():
  return PartitioningEnv(TASK, config=EnvConfig(max_steps=6), pad_to=SIZES)


def _server(builder):
  server = reverb.Server(builder.make_replay_tables())
  return server, reverb.Client(f"localhost:{server.port}")


def _actor(builder, env, client, version=7):
  """Networks, initial parameters and an actor writing to `client` at a fixed version."""
  nets = builder.make_networks()
  params = builder.init_params(nets)
  return nets, params, builder.make_actor(env, nets, _Fixed(params, version),
                                          builder.make_adder(client))


@pytest.mark.slow
def test_network_masks_illegal_actions_and_scores_rows_independently(env):
  obs = env.reset().observation
  nets = make_networks()
  params = nets.init(jax.random.PRNGKey(0), obs)
  out = jax.jit(nets.apply)(params, obs)
  legal = obs["action_mask"]
  assert out.logits.shape == legal.shape and out.value.shape == ()
  assert np.all(np.asarray(out.logits)[~legal] == MASKED)
  assert np.all(np.isfinite(out.logits)) and np.all(np.asarray(out.logits)[legal] > MASKED / 2)
  # A pointer head: permuting the candidate actions permutes their logits.
  perm = np.random.default_rng(0).permutation(legal.shape[0])
  shuffled = dict(obs, actions=obs["actions"][perm], action_nodes=obs["action_nodes"][perm],
                  action_nodes_mask=obs["action_nodes_mask"][perm], action_mask=legal[perm])
  np.testing.assert_allclose(nets.apply(params, shuffled).logits, np.asarray(out.logits)[perm],
                             rtol=1e-5, atol=1e-5)
  # Batched observations give the same answers.
  batch = jax.tree_util.tree_map(lambda x: np.stack([x, x]), obs)
  np.testing.assert_allclose(nets.apply(params, batch).value, [out.value] * 2, rtol=1e-5)


def test_search_and_policy_evaluate_trimmed_padding_to_the_same_answer():
  """Acting trims an observation padded to the training size (4096 nodes) to its own bucket;
  the padding is masked, so the prior, the value and the greedy action do not change."""
  env = PartitioningEnv(TASK, pad_to=Sizes(4096, 8192, 128))
  obs = env.reset().observation
  small = trimmed(obs)
  assert len(small["node_mask"]) == 512 and len(small["senders"]) == 1024
  assert small["node_mask"].sum() == obs["node_mask"].sum()   # every real node kept
  assert len(small["actions"]) == 128
  nets = make_networks()
  params = nets.init(jax.random.PRNGKey(0), obs)
  full = jax.jit(nets.apply)(params, obs)
  probs, value = make_prior_value(nets)(params, obs)
  np.testing.assert_allclose(probs, jax.nn.softmax(full.logits), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(value, full.value, rtol=1e-5, atol=1e-6)
  action, _, _ = make_policy(nets, evaluation=True)(params, jax.random.PRNGKey(1), obs)
  assert int(action) == int(np.argmax(full.logits))
  # One jitted function per network: a second proposal compiles nothing again.
  assert make_policy(nets, evaluation=True) is make_policy(nets, evaluation=True)
  assert make_prior_value(nets) is make_prior_value(nets)


def test_sequence_adder_writes_padded_sequences_with_versions(env):
  builder = make_builder("ppo", dict(sequence_length=4, batch_size=2), SIZES)
  server, client = _server(builder)
  try:
    _, _, actor = _actor(builder, env, client)
    loop = EnvironmentLoop(env, actor, logger=InMemoryLogger())
    lengths = [loop.run_episode()["episode_length"] for _ in range(2)]
    expected = sum(-(-n // 4) for n in lengths)   # ceil(n / T) sequences per episode
    assert client.server_info()["trajectories"].current_size == expected
    batch = next(builder.make_dataset_iterator(client))
    assert batch["valid"].shape == (2, 5) and batch["observation"]["nodes"].shape[:2] == (2, 5)
    assert set(np.unique(batch["version"][batch["valid"] > 0])) == {7}
    # Valid steps come first; after the episode's last action only the final observation and
    # padding follow (valid 0, zero reward).
    for row, reward in zip(batch["valid"], batch["reward"]):
      n = int(row.sum())
      assert np.all(row[:n] == 1) and np.all(row[n:] == 0) and np.all(reward[n:] == 0)
  finally:
    server.stop()


@pytest.mark.parametrize("target", ["visits", "completed_q"])
def test_return_adder_records_returns_to_go_and_policy_targets(env, target):
  builder = make_builder("alphazero", dict(simulations=4, min_replay_size=1, batch_size=1,
                                           samples_per_insert=100.0, policy_target=target), SIZES)
  server, client = _server(builder)
  try:
    _, _, actor = _actor(builder, env, client, version=3)
    rewards = []
    env_ = PartitioningEnv(TASK, config=EnvConfig(max_steps=4), pad_to=SIZES)
    ts = env_.reset()
    actor.observe_first(ts)
    while not ts.last():
      a = actor.select_action(ts.observation)
      ts = env_.step(a)
      rewards.append(float(ts.reward))
      actor.observe(a, ts)
    assert client.server_info()["trajectories"].current_size == len(rewards)
    items = [next(client.sample("trajectories", emit_timesteps=False)) for _ in range(20)]
    template = builder.item_template()
    returns = {float(tree.unflatten_as(template, list(s.data))["return"]) for s in items}
    expected = set(np.round(np.cumsum(rewards[::-1])[::-1], 4))
    assert {round(r, 4) for r in returns} <= expected
    sample = tree.unflatten_as(template, list(items[0].data))
    assert np.isclose(sample["visits"].sum(), 1.0) and int(sample["version"]) == 3
    assert np.all(sample["visits"][~sample["observation"]["action_mask"]] == 0)
  finally:
    server.stop()


@pytest.mark.parametrize("search", [0, 64])   # 64: the shipped recipe's demonstration_search
def test_demonstration_episodes_replay_the_best_known_strategy_with_one_hot_targets(search):
  from agents.alphazero.demonstrations import demonstration_moves
  env = PartitioningEnv(SEARCH_WINS, config=EnvConfig(max_steps=6), pad_to=SIZES)
  # A loose rate limiter: the whole demonstration is written before anything is sampled.
  builder = make_builder("alphazero", dict(simulations=4, min_replay_size=1, batch_size=8,
                                           samples_per_insert=1.0, demonstrations=1.0,
                                           demonstration_search=search), SIZES)
  server, client = _server(builder)
  try:
    _, _, actor = _actor(builder, env, client)
    ts = env.reset()                # the environment the actor was built on
    best = best_expert(evaluate_experts(env))
    assert best.score > 0
    known = demonstration_moves(env, search)
    assert (known == [*best.actions, env.finish_action]) == (search == 0)
    actor.observe_first(ts)
    taken = []
    while not ts.last():
      a = actor.select_action(ts.observation)
      ts = env.step(a)
      actor.observe(a, ts)
      taken.append(a)
    assert taken == known
    assert actor.simulations == 0     # no search per move: every move was demonstrated
    if search:
      assert env.score() > best.score
    else:
      assert np.isclose(env.cost.step_time_s, best.cost.step_time_s)
    template = builder.item_template()
    targets = set()
    for _ in range(12):
      item = next(client.sample("trajectories", emit_timesteps=False))
      sample = tree.unflatten_as(template, list(item.data))
      assert sample["visits"].max() == 1.0 and sample["visits"].sum() == 1.0
      targets.add(int(np.argmax(sample["visits"])))
    assert targets <= set(taken)
  finally:
    server.stop()


def test_unknown_settings_are_clear_errors():
  with pytest.raises(ShardzeroError, match="policy_target"):
    make_builder("alphazero", {"policy_target": "counts"})
  with pytest.raises(ShardzeroError, match="unknown alphazero settings"):
    make_builder("alphazero", {"learning_rte": 1e-3})
  with pytest.raises(ShardzeroError, match="pretrain_learning_rate"):
    make_builder("alphazero", {"pretrain_learning_rate": -1e-2})
  with pytest.raises(ShardzeroError, match="demonstration_search"):
    make_builder("alphazero", {"demonstration_search": -1})


def test_an_expert_that_fits_the_budget_is_demonstrated_even_when_slower():
  from agents.alphazero.demonstrations import demonstration_moves
  from environments import TaskDistribution
  task = Task("resnet:mini,batch=64", "batch=4,model=2")
  roomy = PartitioningEnv(task)
  roomy.reset()
  assert demonstration_moves(roomy) == []     # no expert beats leaving it unpartitioned
  tight, = TaskDistribution((task.model,), meshes=(task.mesh,), budget_fractions=(0.7,)).tasks()
  env = PartitioningEnv(tight)
  ts = env.reset()
  assert env.penalty() > 0
  moves = demonstration_moves(env)
  assert moves[-1] == env.finish_action
  for a in moves:      # as demonstration_items plays them: the episode may end before finish
    if ts.last():
      break
    ts = env.step(a)
  assert ts.last() and env.penalty() == 0
  assert env.cost.step_time_s > env.context.root.cost.step_time_s   # slower, but it fits


def test_demonstrations_leave_no_task_context_in_the_process_cache():
  """The learner demonstrates every training task once: their contexts (and the states a
  search cached in them) are not kept in the process's cache afterwards, and each tight
  budget's demonstration still ends within its budget."""
  from agents.alphazero.demonstrations import demonstration_items
  from environments import EnvConfig, TaskDistribution
  from environments.observations import Sizes
  from environments.tasks import TASKS
  tasks = TaskDistribution(("resnet:mini,batch=64", "mlp:mini"), meshes=("batch=4,model=2",),
                           budget_fractions=(None, 0.7)).tasks()
  sizes = Sizes(4096, 8192, 512)
  items = demonstration_items(tasks, sizes, EnvConfig(), log=None)
  assert items
  for task in tasks:
    assert TASKS.contexts.get((dataclasses.replace(task, memory_budget=None), sizes, True)) is None
  assert all(item["observation"]["node_mask"].shape == (4096,) for item in items)


def test_searched_demonstrations_beat_the_expert_and_keep_only_moves_that_pay():
  """Where a plain search beats every expert, the demonstration is the search's plan, without
  the moves that gain less than PRUNE_TOLERANCE of the step."""
  from agents.alphazero.demonstrations import PRUNE_TOLERANCE, demonstration_moves
  from agents.decoding import score_of
  env = PartitioningEnv(SEARCH_WINS)
  env.reset()
  score = lambda moves: score_of(env, moves)    # None where a move is not legal
  expert = demonstration_moves(env)
  assert expert == [*best_expert(evaluate_experts(env)).actions, env.finish_action]
  moves = demonstration_moves(env, 64)
  assert moves[-1] == env.finish_action and env.history == ()   # env itself is not stepped
  best = score(moves[:-1])
  assert best > score(expert[:-1]) + 0.01   # 0.526 against Megatron's 0.506 (cost model 8)
  for i in range(len(moves) - 1):
    without = score(moves[:i] + moves[i + 1:-1])
    assert without is None or without < best - PRUNE_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "alphazero"])
def test_learner_step_lowers_the_loss_on_a_fixed_batch(env, algorithm):
  if algorithm == "ppo":
    builder = make_builder("ppo", dict(sequence_length=4, batch_size=2, learning_rate=1e-3),
                           SIZES)
  else:
    builder = make_builder("alphazero", dict(simulations=4, batch_size=4, min_replay_size=4,
                                             samples_per_insert=100.0), SIZES)
  server, client = _server(builder)
  try:
    nets, params, actor = _actor(builder, env, client)
    loop = EnvironmentLoop(env, actor, logger=InMemoryLogger())
    while client.server_info()["trajectories"].current_size < 4:
      loop.run_episode()
    batch = next(builder.make_dataset_iterator(client))
  finally:
    server.stop()
  learner = builder.make_learner(nets, params, iter([batch] * 30), logger=InMemoryLogger())
  stripped = {k: v for k, v in batch.items() if k != "version"}
  before = learner.loss(stripped)
  for _ in range(20):
    metrics = learner.step()
  assert learner.version == 20 and metrics["policy_lag"] == 19 - 7   # data of version 7
  assert learner.loss(stripped) < before


def test_variable_client_pulls_published_versions_through_reverb():
  builder = make_builder("ppo", sizes=SIZES)
  server, client = _server(builder)
  try:
    nets = builder.make_networks()
    params = builder.init_params(nets)
    source = ReverbVariableSource(client, builder.params_treedef(nets))
    publish(client, params, 1)
    vc = VariableClient(source, update_period=3)
    vc.update()
    assert vc.version == 1
    bumped = jax.tree_util.tree_map(lambda x: x + 1, params)
    publish(client, bumped, 2)
    vc.update(), vc.update()
    assert vc.version == 1          # not yet: every third call
    vc.update()
    assert vc.version == 2
    leaf = jax.tree_util.tree_leaves(vc.params)[0]
    np.testing.assert_allclose(leaf, jax.tree_util.tree_leaves(params)[0] + 1)
  finally:
    server.stop()


def _uniform_targets_batch(obs, ret: float) -> dict:
  """Two copies of `obs` with a uniform policy target over its legal actions, as replay
  would batch AlphaZero items."""
  return {"observation": jax.tree_util.tree_map(lambda x: np.stack([x] * 2), obs),
          "visits": np.stack([obs["action_mask"] / obs["action_mask"].sum()] * 2)
          .astype(np.float32), "return": np.full(2, ret, np.float32),
          "version": np.zeros(2, np.int64)}


@pytest.mark.slow
def test_checkpoint_round_trip_and_damage(tmp_path, env):
  builder = make_builder("alphazero", sizes=SIZES)
  nets = builder.make_networks()
  batch = _uniform_targets_batch(env.reset().observation, ret=0.0)
  learner = builder.make_learner(nets, builder.init_params(nets), iter([batch] * 5),
                                 logger=InMemoryLogger())
  learner.step(), learner.step()
  path = str(tmp_path / checkpointing.FILENAME)
  checkpointing.save(path, {"learner": learner.save()})
  fresh = builder.make_learner(nets, builder.init_params(nets, seed=1), iter([batch] * 5),
                               logger=InMemoryLogger())
  fresh.restore(checkpointing.load(path)["learner"])
  assert fresh.version == 2
  np.testing.assert_allclose(jax.tree_util.tree_leaves(fresh.get_variables(["policy"])[0])[0],
                             jax.tree_util.tree_leaves(learner.get_variables(["policy"])[0])[0])
  assert fresh.step()["steps"] == 3           # the counter continues too
  data = bytearray(open(path, "rb").read())
  data[-10] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with pytest.raises(checkpointing.CheckpointError, match="damaged"):
    checkpointing.load(path)
  (tmp_path / "other").write_text("hello")
  with pytest.raises(checkpointing.CheckpointError, match="not a shardzero checkpoint"):
    checkpointing.load(str(tmp_path / "other"))
  with pytest.raises(checkpointing.CheckpointError, match="no checkpoint"):
    checkpointing.load(str(tmp_path / "missing"))


def test_a_policy_checkpoint_of_another_network_is_a_clear_error(tmp_path):
  """Same modules, other shapes (another hidden size, or observations of another version)."""
  from learners.policies import load_policy
  builder = make_builder("alphazero", sizes=SIZES)
  nets = builder.make_networks()
  learner = builder.make_learner(nets, builder.init_params(nets), iter([]),
                                 logger=InMemoryLogger())
  checkpointing.save(str(tmp_path / checkpointing.FILENAME), {"learner": learner.save()})
  config = RunConfig(algorithm="alphazero", sizes=tuple(SIZES))
  dataclasses.replace(config, network={"hidden": 8}).save(str(tmp_path))
  with pytest.raises(checkpointing.CheckpointError, match="does not fit the network"):
    load_policy(str(tmp_path))
  # A run from before observations had versions (no key) was trained on version 1.
  (tmp_path / "config.json").write_text(json.dumps({"algorithm": "alphazero",
                                                    "sizes": list(SIZES)}))
  with pytest.raises(checkpointing.CheckpointError, match="version 1.*train it again"):
    load_policy(str(tmp_path))
  config.save(str(tmp_path))
  assert load_policy(str(tmp_path)).version == 0


def test_learner_source_serves_current_version(env):
  builder = make_builder("ppo", sizes=SIZES)
  nets = builder.make_networks()
  learner = builder.make_learner(nets, builder.init_params(nets), iter([]),
                                 logger=InMemoryLogger())
  params, version = LearnerVariableSource(learner).get_variables(["policy"])[0]
  assert version == 0 and dataclasses.is_dataclass(builder.config)


def test_parameter_average_is_the_moving_average_and_what_propose_loads(tmp_path, env):
  """With ema_decay the learner keeps avg <- d * avg + (1 - d) * params after every update;
  it is checkpointed, survives a restore, and is what `load_policy` returns."""
  from learners.policies import load_policy
  decay = 0.5
  builder = make_builder("alphazero", dict(ema_decay=decay), SIZES)
  assert builder.evaluation_variables == "average"
  nets = builder.make_networks()
  batch = _uniform_targets_batch(env.reset().observation, ret=1.0)
  init = builder.init_params(nets)
  learner = builder.make_learner(nets, init, iter([batch] * 10), logger=InMemoryLogger())
  leaf = lambda tree: np.asarray(jax.tree_util.tree_leaves(tree)[-1], np.float64)
  expected = leaf(init)
  for _ in range(3):
    learner.step()
    expected = decay * expected + (1 - decay) * leaf(learner.get_variables(["policy"])[0])
  average, latest = learner.get_variables(["average", "policy"])
  np.testing.assert_allclose(leaf(average), expected, rtol=1e-5, atol=1e-7)
  assert not np.allclose(leaf(average), leaf(latest))
  assert LearnerVariableSource(learner, "average").get_variables(["x"])[0][1] == 3
  with pytest.raises(KeyError, match="unknown variables"):
    learner.get_variables(["target"])
  checkpointing.save(str(tmp_path / checkpointing.FILENAME), {"learner": learner.save()})
  RunConfig(algorithm="alphazero", sizes=tuple(SIZES), settings={"ema_decay": decay}).save(
      str(tmp_path))
  np.testing.assert_allclose(leaf(load_policy(str(tmp_path)).params), leaf(average))
  fresh = builder.make_learner(nets, builder.init_params(nets, seed=1), iter([batch]),
                               logger=InMemoryLogger())
  fresh.restore(checkpointing.load(str(tmp_path))["learner"])
  np.testing.assert_allclose(leaf(fresh.get_variables(["average"])[0]), leaf(average))
  # Without an average the latest parameters are served under both names and loaded.
  plain = make_builder("alphazero", sizes=SIZES)
  assert plain.evaluation_variables == "policy"
  plain_learner = plain.make_learner(nets, init, iter([batch]), logger=InMemoryLogger())
  plain_learner.restore(checkpointing.load(str(tmp_path))["learner"])
  average, latest = plain_learner.get_variables(["average", "policy"])
  np.testing.assert_allclose(leaf(average), leaf(latest))
  with pytest.raises(ShardzeroError, match="ema_decay"):
    make_builder("alphazero", {"ema_decay": 1.0})


def _step_sizes(optimizer, steps):
  """How far each of `steps` updates moves a parameter under a constant gradient: about the
  learning rate, for Adam."""
  import jax.numpy as jnp
  params = {"w": jnp.ones(3)}
  state, sizes = optimizer.init(params), []
  for _ in range(steps):
    updates, state = optimizer.update({"w": jnp.full(3, 0.1)}, state, params)
    sizes.append(float(jnp.abs(updates["w"][0])))
  return sizes


def test_cloning_updates_use_the_pretrain_learning_rate():
  """Adam's first steps move each parameter by about the learning rate: the pretrain rate for
  the first `pretrain_steps` updates, then the search-phase rate."""
  builder = make_builder("alphazero", {"pretrain_steps": 2, "pretrain_learning_rate": 0.5,
                                       "learning_rate": 1e-3, "weight_decay": 0.0})
  np.testing.assert_allclose(_step_sizes(builder.make_optimizer(), 4), [0.5, 0.5, 1e-3, 1e-3],
                             rtol=1e-3)
  plain = make_builder("alphazero", {"pretrain_steps": 2, "learning_rate": 1e-3,
                                     "weight_decay": 0.0}).make_optimizer()
  np.testing.assert_allclose(_step_sizes(plain, 1), [1e-3], rtol=1e-3)


def test_search_learning_rate_decays_along_a_cosine_after_cloning():
  """With `decay_steps` the rate after cloning falls from `learning_rate` to zero along a
  cosine: half-way it is half the rate, at the end zero, and cloning keeps its own rate."""
  builder = make_builder("alphazero", {"pretrain_steps": 2, "pretrain_learning_rate": 0.5,
                                       "learning_rate": 1e-2, "decay_steps": 4,
                                       "weight_decay": 0.0})
  np.testing.assert_allclose(_step_sizes(builder.make_optimizer(), 7),
                             [0.5, 0.5, 1e-2, 1e-2 * (1 + np.cos(np.pi / 4)) / 2, 5e-3,
                              1e-2 * (1 - np.cos(np.pi / 4)) / 2, 0.0], rtol=1e-3, atol=1e-7)
  without_cloning = make_builder("alphazero", {"learning_rate": 1e-2, "decay_steps": 2,
                                               "weight_decay": 0.0}).make_optimizer()
  np.testing.assert_allclose(_step_sizes(without_cloning, 3), [1e-2, 5e-3, 0.0], rtol=1e-3,
                             atol=1e-7)
  with pytest.raises(ShardzeroError, match="decay_steps"):
    make_builder("alphazero", {"decay_steps": -1})


def test_the_policy_cache_reloads_a_changed_checkpoint_and_keeps_few(tmp_path):
  import os
  from learners.policies import PolicyCache
  builder = make_builder("alphazero", sizes=SIZES)
  nets = builder.make_networks()
  learner = builder.make_learner(nets, builder.init_params(nets), iter([]),
                                 logger=InMemoryLogger())
  runs = []
  for i in range(2):
    run = tmp_path / f"run{i}"
    RunConfig(algorithm="alphazero", sizes=tuple(SIZES)).save(str(run))
    checkpointing.save(str(run / checkpointing.FILENAME), {"learner": learner.save()})
    runs.append(str(run))
  cache = PolicyCache(size=1)
  first = cache(runs[0])
  assert cache(runs[0]) is first
  path = os.path.join(runs[0], checkpointing.FILENAME)
  stamp = os.path.getmtime(path) + 10
  os.utime(path, (stamp, stamp))                 # a newer checkpoint: loaded again
  second = cache(runs[0])
  assert second is not first and cache(runs[0]) is second
  cache(runs[1])                                 # size 1: the other run is dropped
  assert cache(runs[0]) is not second

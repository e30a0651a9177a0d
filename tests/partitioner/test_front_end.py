"""Programs written by others: pytree arguments with constants in them, roles from the
dataflow whatever the arguments are called, layers scanned over stacked weights, and the jit
lowering of concatenates that XLA's CPU partitioner gets wrong."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import partitioner as P
from partitioner import roles as R
from partitioner.verify import verify
from tests.partitioner import user_models


class Config(NamedTuple):
  scale: float
  name: str
  activation: object


@dataclasses.dataclass
class Holder:
  w: jax.Array
  step: int
  tag: str | None


jax.tree_util.register_dataclass(Holder, data_fields=["w", "step", "tag"], meta_fields=[])


def test_leaves_that_are_not_arrays_are_constants_of_the_trace():
  def step(params, holder, config, batch):
    h = config.activation(batch["x"] @ params["w"]) * config.scale
    return {"w": params["w"] - 0.1 * (h.T @ batch["x"]).T}, h.sum() + holder.w.sum() * holder.step

  params = {"w": jnp.ones((4, 6)) * 0.1}
  holder = Holder(jnp.ones((3,)), 2, None)
  config = Config(0.5, "relu", jax.nn.relu)
  batch = {"x": jax.random.normal(jax.random.PRNGKey(0), (8, 4))}
  program = P.trace(step, params, holder, config, batch)
  assert program.input_names == ("params/w", "holder/w", "batch/x")
  pp = P.apply(program, "batch=4", "BatchParallel(batch)")
  assert verify(pp, (params, holder, config, batch)).ok
  # The same call runs through both lowerings; a different constant is refused.
  np.testing.assert_allclose(pp.jit()(params, holder, config, batch)[1],
                             step(params, holder, config, batch)[1], rtol=1e-5)
  with pytest.raises(ValueError, match="was the constant 2 when the program was traced"):
    pp.lower_spmd()(params, Holder(holder.w, 3, None), config, batch)


def test_a_function_that_fails_to_trace_is_one_workload_error():
  def broken(params):
    return params["missing"]

  with pytest.raises(P.WorkloadError, match=r"tracing broken failed: KeyError: 'missing'"):
    P.trace(broken, {"w": jnp.ones(3)})


def _mlp_three_ways():
  """One MLP training step spelled as (params, opt_state, batch), (p, o, t) and a Flax
  TrainState (a Python step count, static apply_fn and tx)."""
  from flax.training import train_state
  tx = optax.adam(1e-2)
  params = {"Dense_0": {"kernel": jnp.ones((16, 64)) * 0.1, "bias": jnp.zeros(64)},
            "Dense_1": {"kernel": jnp.ones((64, 8)) * 0.1, "bias": jnp.zeros(8)}}
  batch = {"x": jax.random.normal(jax.random.PRNGKey(0), (32, 16)),
           "y": jax.random.normal(jax.random.PRNGKey(1), (32, 8))}

  def apply(p, x):
    return jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]) @ p["Dense_1"]["kernel"] \
        + p["Dense_1"]["bias"]

  def loss(p, b):
    return jnp.mean((apply(p, b["x"]) - b["y"]) ** 2)

  def named(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def short(p, o, t):
    return named(p, o, t)

  def with_state(state, batch):
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    return state.apply_gradients(grads=grads), value

  state = train_state.TrainState.create(apply_fn=apply, params=params, tx=tx)
  return {"named": (named, (params, tx.init(params), batch)),
          "short": (short, (params, tx.init(params), batch)),
          "train_state": (with_state, (state, batch))}


def _suffixes(program, ids):
  """Role members by the path they end with (their own argument names differ)."""
  return sorted(program.name(v).split("/", 1)[1].replace("params/", "").replace("opt_state/", "")
                for v in ids)


@pytest.mark.slow
def test_jax_random_inside_the_step_traces_exactly_and_partitions():
  """Dropout with `jax.random` (typed keys between its calls): the keys are threefry on their
  raw uint32 data in the IR, bit for bit what JAX draws; the step verifies partitioned."""
  def step(params, batch):
    def loss(p):
      k1, k2 = jax.random.split(batch["key"])
      h = jnp.tanh(batch["x"] @ p["w"])
      h = h * jax.random.bernoulli(jax.random.fold_in(k1, 7), 0.9, h.shape) / 0.9
      noise = jax.vmap(lambda k: jax.random.normal(k, (4,)))(jax.random.split(k2, 8))
      return jnp.mean((h - noise) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return {"w": params["w"] - 0.1 * grads["w"]}, value

  params = {"w": jnp.full((4, 4), 0.1)}
  batch = {"x": jnp.ones((8, 4)), "key": jax.random.key_data(jax.random.key(3))}
  program = P.trace(step, params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(step(params, batch)),
                  jax.tree_util.tree_leaves(program(params, batch))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  (params, batch))
  result = verify(P.apply(program, "batch=8", "BatchParallel(batch)"), shapes)
  assert result.ok, result
  with pytest.raises(P.WorkloadError, match="batch/key is a typed PRNG key.*key_data"):
    P.trace(step, params, {**batch, "key": jax.random.key(3)})


def test_three_spellings_of_one_step_get_the_same_roles_points_and_costs():
  from environments.actions import decision_points
  from partitioner.cost import simulate
  results = {}
  for style, (fn, args) in _mlp_three_ways().items():
    program = P.trace(fn, *args)
    roles = R.roles(program)
    points = sorted((d.role, len(d.members), d.shape) for d in decision_points(program))
    costs = []
    for schedule in ("BatchParallel(batch)", "BatchParallel(batch); Megatron(model)",
                     "ZeRO(batch, stage=3)", "BatchParallel(batch); ZeRO(batch, stage=1)"):
      pp = P.apply(program, "batch=4,model=2", schedule)
      report = simulate(pp, "h100")
      costs.append((round(report.step_time_s, 12), report.memory.breakdown["parameters"],
                     report.memory.breakdown["optimizer_state"]))
      if style == "train_state":   # the spelling furthest from the plain step runs, too
        assert verify(pp, args).ok, (style, schedule)
    results[style] = (_suffixes(program, roles.params), _suffixes(program, roles.opt_state),
                      _suffixes(program, roles.data), points, costs)
  assert results["named"][0] == ["Dense_0/bias", "Dense_0/kernel", "Dense_1/bias",
                                 "Dense_1/kernel"]
  assert len(results["named"][1]) == 9    # mu and nu of each weight, and the step count
  assert results["named"][2] == ["x", "y"]
  assert results["short"] == results["named"]
  assert results["train_state"][:3] == results["named"][:3]
  assert results["train_state"][3] == results["named"][3]
  for a, b in zip(results["train_state"][4], results["named"][4]):
    assert a[1:] == b[1:] and a[0] == pytest.approx(b[0], rel=1e-6)


def test_model_state_is_neither_parameter_nor_optimizer_state():
  import corpus
  workload = corpus.load("resnet:small", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  roles = R.roles(program)
  assert roles.model_state and all(program.name(v).startswith("model_state/")
                                   for v in roles.model_state)
  assert all(program.name(v).startswith("params/") for v in roles.params)
  assert all(program.name(v).startswith("opt_state/") for v in roles.opt_state)


def test_a_step_that_returns_only_its_new_state_has_a_forward_pass():
  """`return params, opt_state` and no loss: the forward pass is what `jax.grad`'s seed (the
  constant 1.0 it transposes the loss from) does not start, so Megatron finds the forward
  matmuls, not the backward ones that read the same weights, and the plan verifies. A
  `jnp.ones` mask in the forward pass reads 1.0 too and is not taken for the seed."""
  optimizer = optax.adam(1e-3)

  def loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"]) * jnp.ones((32, 256))
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  key1, key2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w1": jax.random.normal(key1, (64, 256)) * 0.1,
            "w2": jax.random.normal(key2, (256, 64)) * 0.1}
  args = (params, optimizer.init(params), {"x": jnp.ones((32, 64)), "y": jnp.zeros((32, 64))})
  program = P.trace(step, *args)
  forward = R.forward_ops(program)
  matmuls = [i for i, op in enumerate(program.ops) if op.name == "dot_general"]
  assert [i in forward for i in matmuls] == [True, True, False, False, False]
  pp = P.apply(program, "batch=4,model=2", "BatchParallel(batch); Megatron(model)")
  # Column- then row-parallel, as Megatron splits a pair.
  assert pp.sharding("params/w1").dims == ((), ("model",))
  assert pp.sharding("params/w2").dims == (("model",), ())
  assert verify(pp, args).ok


def test_a_train_state_step_that_returns_only_the_state_has_a_forward_pass():
  """`return state.apply_gradients(grads=grads)` with a Flax TrainState whose step is a Python
  int: the new step count is an output that is not state, but no input reaches it, so it is
  not taken for the loss; the forward pass comes from the gradient's seed, and Megatron splits
  the pair and verifies."""
  from flax.training import train_state

  def apply(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]

  def step(state, batch):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2))(
        state.params)
    return state.apply_gradients(grads=grads)

  key1, key2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w1": jax.random.normal(key1, (64, 256)) * 0.1,
            "w2": jax.random.normal(key2, (256, 64)) * 0.1}
  state = train_state.TrainState.create(apply_fn=apply, params=params, tx=optax.sgd(0.1))
  args = (state, {"x": jnp.ones((32, 64)), "y": jnp.zeros((32, 64))})
  program = P.trace(step, *args)
  assert R.loss_outputs(program) == () and len(program.outputs) > len(program.aliases)
  pp = P.apply(program, "batch=4,model=2", "BatchParallel(batch); Megatron(model)")
  assert pp.sharding("state/params/w1").dims == ((), ("model",))
  assert pp.sharding("state/params/w2").dims == (("model",), ())
  assert verify(pp, args).ok


def test_bfloat16_data_is_data():
  """bfloat16 is NumPy kind "V", as typed PRNG keys are: a bfloat16 batch is still the data
  that BatchParallel splits."""
  def step(params, batch):
    grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(params)
    return {"w": params["w"] - 0.1 * grads["w"]}

  args = ({"w": jnp.ones((16, 8), jnp.bfloat16)}, {"x": jnp.ones((32, 16), jnp.bfloat16)})
  program = P.trace(step, *args)
  assert [program.name(v) for v in R.roles(program).data] == ["batch/x"]
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  assert pp.sharding("batch/x").dims == (("batch",), ())


def test_concatenate_of_a_sharded_dimension_under_partial_replication_lowers_exactly():
  # XLA's CPU partitioner returns this concatenate multiplied by the replica count
  # (jax-ml/jax#19106); the jit lowering emits it as a sum of padded pieces.
  def f(x):
    return jnp.concatenate([x[i:i + 1] * (i + 1) for i in range(4)], 0)

  x = jnp.arange(4 * 64, dtype=jnp.float32).reshape(4, 64)
  program = P.trace(f, x)
  pp = P.apply(program, "batch=4,model=2", "Tile(out, 0, batch)")
  result = verify(pp, (x,), rtol=0, atol=0)
  assert result.ok, result.errors


@pytest.fixture(scope="module")
def scanned():
  fn, args = user_models.scanned_decoder(layers=4)
  return fn, args, P.trace(fn, *args)


@pytest.mark.slow
def test_stacked_layer_weights_are_split_by_megatron_and_never_along_the_layer_dim(scanned):
  fn, args, program = scanned
  stacked = R.stacked_dims(program)
  names = {program.name(v): d for v, d in stacked.items()}
  assert names["params/layers/w1"] == 0 and names["opt_state/0/mu/layers/w1"] == 0
  pp = P.apply(program, "batch=4,model=2", "BatchParallel(batch); Megatron(model)")
  shardings = pp.summary()["shardings"]
  assert shardings["params/layers/w1"] == [None, None, "model"]
  assert shardings["params/layers/w2"] == [None, "model"]
  assert shardings["params/layers/wq"] == [None, None, "model"]
  assert shardings["params/layers/wo"] == [None, "model"]
  assert shardings["batch/tokens"][0] == "batch"
  assert verify(pp, args).ok
  zero = P.apply(program, "batch=8", "ZeRO(batch, stage=3)")
  for name, spec in zero.summary()["shardings"].items():
    if "layers/" in name and spec:
      assert spec[0] is None, name   # the layer dimension stays whole


@pytest.mark.slow
def test_layer_dimension_tiled_by_hand_verifies_in_both_lowerings(scanned):
  fn, args, program = scanned
  pp = P.apply(program, "batch=4,model=2",
               "Tile(params/layers/**, 0, batch); Tile(opt_state/**/layers/**, 0, batch)")
  result = verify(pp, args)
  assert result.ok and result.errors["jit"] < 1e-5, result.errors


@pytest.mark.slow
def test_gpt_with_layer_stack_partitions_like_its_unrolled_twin():
  import corpus
  from partitioner.cost import simulate
  workload = corpus.load("gpt:small,layers=4,scan=true")
  program = P.trace(workload.fn, *workload.args)
  assert program.regions == ()   # unrolled when traced: 4 layers are short
  assert [(l["length"], l["unrolled"]) for l in program.loops] == [(4, True), (4, True)]
  assert any("__layer_stack" in n for n in program.input_names)
  # (Megatron over the stack with its loops kept verifies in tests/partitioner/test_pipeline.py)
  pp = P.apply(program, "batch=2,model=4", corpus.experts("gpt")["zero3"])
  assert verify(pp, workload.args).ok
  # At a realistic width the stacked and the unrolled model need the same memory: a stack of
  # per-layer values sliced back layer by layer is never made (XLA's footprints of the two,
  # gpt:small,layers=4,batch=32,seq=64 on 8 CPU devices, differ by 1-4%).
  twins = [P.trace(w.fn, *w.args) for w in (
      corpus.load("gpt:mini,layers=4,scan=true", abstract=True),
      corpus.load("gpt:mini,layers=4", abstract=True))]
  for name in ("dp", "dp+megatron", "zero3"):
    a, b = (simulate(P.apply(p, "batch=4,model=8", corpus.experts("gpt")[name]), "h100")
            for p in twins)
    assert a.memory.peak_bytes == pytest.approx(b.memory.peak_bytes, rel=0.06), name


@pytest.mark.parametrize("mesh,kv_split", [("batch=4,model=2", True), ("batch=2,model=4", False)])
def test_grouped_kv_heads_are_split_where_they_divide_and_reported_where_not(mesh, kv_split):
  fn, args = user_models.grouped_query_attention(heads=4, kv_heads=2)
  program = P.trace(fn, *args)
  pp = P.apply(program, mesh, "BatchParallel(batch); Megatron(model)")
  shardings = pp.summary()["shardings"]
  assert shardings["params/wq"] == [None, "model"]
  assert (shardings["params/wk"] == [None, "model"]) == kv_split
  assert (shardings["params/wv"] == [None, "model"]) == kv_split
  notes = [n for r in pp.reports for n in r.notes if "left whole" in n]
  assert bool(notes and "params/wk, params/wv" in notes[0]) != kv_split
  assert verify(pp, args).ok


def test_stacked_micro_batches_are_split_along_the_batch_not_the_loop():
  fn, args = user_models.microbatched_mlp(accum=4, batch=16)
  program = P.trace(fn, *args)
  assert R.batch_dim(program, program.value("micro/x").id) == 1
  for schedule in ("BatchParallel(batch)", "ZeRO(batch, stage=3)"):
    pp = P.apply(program, "batch=8", schedule)
    assert pp.summary()["shardings"]["micro/x"] == [None, "batch"], schedule
    assert verify(pp, args).ok, schedule
  explicit = P.apply(program, "batch=4", "BatchParallel(batch, dim=0)")
  assert explicit.summary()["shardings"]["micro/x"] == ["batch"]

"""Fused projections held interleaved and vocabularies padded (partitioner/layouts.py): found
from the dataflow when a step is traced, they split where the user's layout cannot, both
lowerings stay exact against the user's program, and the padding is priced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner as P
from partitioner.cost import simulate
from partitioner.layouts import Interleaved, Padded
from partitioner.verify import example_inputs, verify
from tests.partitioner.helpers import momentum_step

B, T, D, H, V = 8, 8, 32, 4, 1090   # 1,090 rows: padded to 1,152, which 2, 4 and 8 divide


def _step(cumsum=False, scan=False, untied=False):
  """Attention with a fused q/k/v projection and an embedding tied to the output head, trained
  with momentum: what HF GPT-2 does, small. `untied`: an output head of its own (Llama's)."""
  def loss_fn(p, batch):
    h = p["emb"][batch["tokens"]]
    heads = lambda x: x.reshape(*x.shape[:2], H, D // H)

    def attention(h, w):
      q, k, v = jnp.split(h @ w["qkv"] + w["b"], 3, axis=-1)
      a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", heads(q), heads(k)), -1)
      return h + jnp.einsum("bhts,bshd->bthd", a, heads(v)).reshape(h.shape) @ w["o"]

    if scan:
      h, _ = jax.lax.scan(lambda h, w: (attention(h, w), None), h, p["layers"])
    else:
      h = attention(h, p["layers"])
    logits = h @ (p["head"] if untied else p["emb"].T)
    if cumsum:   # an op that indexes the vocabulary by position: run on the user's layout
      logits = logits - 0.01 * jnp.cumsum(logits, axis=-1)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

  step = momentum_step(loss_fn)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  lead = (2,) if scan else ()
  params = {"emb": f32(V, D), "layers": {"qkv": f32(*lead, D, 3 * D), "b": f32(*lead, 3 * D),
                                         "o": f32(*lead, D, D)}}
  if untied:
    params["head"] = f32(D, V)
  batch = {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
           "labels": jax.ShapeDtypeStruct((B, T), jnp.int32)}
  return step, (params, params, batch)


def _args(args, seed=0):
  """Concrete arguments, with tokens and labels anywhere in the vocabulary."""
  rng = np.random.default_rng(seed)
  leaves = [jnp.asarray(rng.integers(0, V, x.shape), x.dtype) if x.dtype == np.int32 else x
            for x in example_inputs(args, seed)]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), leaves)


@pytest.fixture(scope="module")
def traced():
  step, args = _step()
  return P.trace(step, *args), args


def test_the_fused_kernel_is_interleaved_and_the_table_padded_with_their_state(traced):
  program, _ = traced
  held = {program.input_names[k]: lay for k, lay in program.layouts.items()}
  for tree in ("params", "momentum"):
    assert held[f"{tree}/layers/qkv"] == Interleaved(1, 3)
    assert held[f"{tree}/layers/b"] == Interleaved(0, 3)
    assert held[f"{tree}/emb"] == Padded(0, V, 1152)
  assert len(held) == 6 and len(program.output_layouts) == 6
  assert program.value("params/emb").shape == (1152, D)
  assert program.root.value("params/emb").shape == (V, D) and program.root.layouts == {}
  step, args = _step()
  assert P.trace(step, *args, layouts=False).layouts == {}


def test_layouts_store_and_load_back():
  x = jnp.arange(12.0).reshape(2, 6)
  interleaved = Interleaved(1, 3)
  np.testing.assert_array_equal(interleaved.store(x)[0], [0, 2, 4, 1, 3, 5])
  np.testing.assert_array_equal(interleaved.load(interleaved.store(x)), x)
  padded = Padded(1, 6, 8)
  np.testing.assert_array_equal(padded.store(x)[:, 6:], 0)
  np.testing.assert_array_equal(padded.load(padded.store(x)), x)


def test_the_held_program_computes_what_the_users_does(traced):
  program, args = traced
  inputs = program.root.flatten_args(_args(args))
  expected = program.root.evaluate(*inputs)
  got = program.load_outputs(program.evaluate(*program.store_inputs(inputs)))
  for a, b in zip(expected, got):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", [
    "BatchParallel(batch); Megatron(model); EmbeddingSharding(model)",
    "BatchParallel(batch); Megatron(model); EmbeddingSharding(model); ZeRO(batch, stage=3)",
    "BatchParallel(batch); BatchParallel(model); ZeRO(model, stage=3)",
])
def test_held_values_split_without_gathers_and_verify(traced, schedule):
  program, args = traced
  pp = P.apply(program, "batch=2,model=4", schedule)
  dims = pp.input_shardings()
  if "Megatron" in schedule:
    assert dims["params/layers/qkv"].dims[1] == ("model",)
    assert dims["params/emb"].dims[0] == ("model",)
    # Each device's heads and vocabulary rows stay on it: nothing is gathered over `model`.
    assert not [c for c in pp.collectives if c.kind == "all-gather" and "model" in c.axes]
  result = verify(pp, _args(args))
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"
  # Called like the user's step: the user's shapes in and out.
  params, momentum, loss = pp.jit()(*_args(args))
  assert params["emb"].shape == (V, D) and params["layers"]["qkv"].shape == (D, 3 * D)


def test_an_untied_output_head_is_padded_and_megatron_splits_it():
  """An output head of its own whose vocabulary divides by nothing is padded like a table
  (with its momentum), Megatron splits it by columns, and the step stays the user's."""
  step, args = _step(untied=True)
  program = P.trace(step, *args)
  held = {program.input_names[k]: lay for k, lay in program.layouts.items()}
  assert held["params/head"] == held["momentum/head"] == Padded(1, V, 1152)
  assert held["params/emb"] == Padded(0, V, 1152)
  pp = P.apply(program, "batch=2,model=4", "BatchParallel(batch); Megatron(model)")
  assert pp.input_shardings()["params/head"].dims == ((), ("model",))
  result = verify(pp, _args(args))
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"
  params, _, _ = pp.jit()(*_args(args))
  assert params["head"].shape == (D, V)


def test_an_op_that_indexes_the_padding_by_position_reads_the_users_layout():
  step, args = _step(cumsum=True)
  program = P.trace(step, *args)
  assert any(isinstance(lay, Padded) for lay in program.layouts.values())
  pp = P.apply(program, "batch=2,model=4", "BatchParallel(batch); EmbeddingSharding(model)")
  result = verify(pp, _args(args))
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_the_padding_is_priced():
  step, args = _step()
  flops = lambda program, schedule: simulate(P.apply(program, "batch=2,model=4", schedule),
                                             "h100").flops
  users, held = P.trace(step, *args, layouts=False), P.trace(step, *args)
  # The padded rows are multiplied and updated like the others, and masked out of the softmax
  # (a select per element of five logit-sized values): a little more work...
  assert flops(users, "BatchParallel(batch)") < flops(held, "BatchParallel(batch)") < \
      flops(users, "BatchParallel(batch)") * 1.1
  # ...that splits four ways, where the user's 1,090 rows stay whole.
  split = "BatchParallel(batch); EmbeddingSharding(model)"
  assert flops(held, split) < 0.8 * flops(users, split)


def test_a_fused_projection_in_a_loop_is_left_in_the_users_layout():
  step, args = _step(scan=True)
  program = P.trace(step, *args, loops="keep")
  assert program.regions
  assert all(not isinstance(lay, Interleaved) for lay in program.layouts.values())
  pp = P.apply(program, "batch=2,model=4", "BatchParallel(batch); EmbeddingSharding(model)")
  result = verify(pp, _args(args))
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_micro_batches_cut_the_held_program():
  step, args = _step()
  program = P.trace(step, *args)
  pp = P.apply(program, "batch=2,model=4",
               "Microbatch(2); BatchParallel(batch); Megatron(model); EmbeddingSharding(model)")
  assert pp.program.microbatches == 2 and pp.program.layouts == program.layouts
  assert pp.program.root is program.root
  result = verify(pp, _args(args))
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_a_rewrite_that_fails_leaves_the_users_layout_with_a_warning(monkeypatch):
  from partitioner import layouts
  step, args = _step()

  def broken(*a, **k):
    raise RuntimeError("planted")

  monkeypatch.setattr(layouts, "_chunk_op", broken)
  with pytest.warns(UserWarning, match="keeps the user's layout"):
    program = P.trace(step, *args)
  assert program.layouts == {} and program.value("params/emb").shape == (V, D)

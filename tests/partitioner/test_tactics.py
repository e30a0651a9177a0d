"""Manual tactics find their targets from the IR and names, and mean what their names say."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corpus
import partitioner as P
from partitioner.errors import PatternError, ScheduleError
from tests.partitioner.helpers import run_both


@functools.lru_cache(maxsize=None)
def traced(spec):
  workload = corpus.load(spec)
  return workload, P.trace(workload.fn, *workload.args)


def sharded_inputs(pp, prefix="params/"):
  return {n: s.dims for n, s in pp.input_shardings().items() if n.startswith(prefix) and
          any(s.dims)}


# ----------------------------------------------------------------------------- schedule syntax
def test_schedule_parses_and_prints_back():
  text = "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1); Tile(params/**/w, 1, model)"
  tactics = P.parse_schedule(text)
  assert tactics == [P.BatchParallel("batch"), P.Megatron("model"), P.ZeRO("batch", stage=1),
                     P.Tile("params/**/w", 1, "model")]
  assert "; ".join(map(str, tactics)) == text
  assert P.parse_schedule("Replicate('params/gpt/embed/**', 'batch')") == [
      P.Replicate("params/gpt/embed/**", "batch")]


@pytest.mark.parametrize("text,message", [
    ("Megatorn(model)", "unknown tactic 'Megatorn'; known: Auto, BatchParallel"),
    ("Tile(x, 0)", r"bad arguments for Tile\(value, dim, axis\)"),
    ("BatchParallel(batch", "cannot parse tactic"),
    ("ZeRO(batch, stage=4)", "ZeRO stage must be 1, 2 or 3"),
])
def test_bad_schedules_are_clear_errors(text, message):
  _, program = traced("mlp:small")
  with pytest.raises(ScheduleError, match=message):
    P.apply(program, "batch=8", text)


# ----------------------------------------------------------------------------- targets
def test_batch_parallel_splits_the_data_inputs():
  _, program = traced("gpt:small")
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  assert sharded_inputs(pp, "batch/") == {"batch/inputs": (("batch",), ()),
                                          "batch/targets": (("batch",), ())}
  assert not sharded_inputs(pp)


def test_batch_parallel_needs_a_data_input():
  program = P.trace(lambda params: params["w"].sum(), {"w": jnp.ones((8, 8))})
  with pytest.raises(PatternError, match="found no data input"):
    P.apply(program, "batch=8", "BatchParallel(batch)")


def test_megatron_splits_columns_then_rows_and_heads():
  _, program = traced("gpt:small")
  pp = P.apply(program, "model=8", "Megatron(model)")
  weights = {n: d for n, d in sharded_inputs(pp).items() if n.endswith("/w")}
  for layer in (0, 1):
    prefix = f"params/gpt/layer_{layer}/"
    for column in ("attn/query", "attn/key", "attn/value", "w_in"):
      assert weights.pop(prefix + column + "/w") == ((), ("model",))
    for row in ("attn/out", "w_out"):
      assert weights.pop(prefix + row + "/w") == (("model",), ())
  assert not weights  # embeddings, layer norms untouched
  # Column biases follow their weights; optimizer state follows its parameter.
  assert pp.sharding("params/gpt/layer_0/w_in/b").dims == (("model",),)
  assert pp.sharding("opt_state/1/0/mu/gpt/layer_0/w_in/w").dims == ((), ("model",))
  # Outputs (the updated parameters) keep the layout of the inputs.
  assert pp.output_shardings()["out/0/gpt/layer_0/w_in/w"].dims == ((), ("model",))


def _lm_step(loss, vocab=64):
  """A two-layer MLP language model with an untied output head (d_model 16), trained by SGD
  under `loss` ("softmax": cross-entropy on the logits; "squares": a regression on them)."""
  def step(params, batch):
    def objective(p):
      x = p["embed"][batch["tokens"]]
      x = x + jax.nn.relu(x @ p["w_in"]) @ p["w_out"]
      logits = x @ p["head"]
      if loss == "squares":
        return jnp.mean((logits - 1.0) ** 2)
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1))
    value, grads = jax.value_and_grad(objective)(params)
    return value, jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads)
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  params = {"embed": jax.random.normal(keys[0], (vocab, 16)),
            "w_in": jax.random.normal(keys[1], (16, 32)) / 4,
            "w_out": jax.random.normal(keys[2], (32, 16)) / 6,
            "head": jax.random.normal(keys[3], (16, vocab)) / 4}
  batch = {"tokens": jax.random.randint(keys[4], (8, 4), 0, vocab),
           "labels": jax.random.randint(keys[5], (8, 4), 0, vocab)}
  return step, (params, batch)


def test_megatron_splits_an_untied_output_head_by_its_vocabulary():
  """As Megatron-LM's output layer: each device computes its share of the logits, and what
  crosses the devices per token is the softmax's statistics (maximum, sum, the label's
  logit) and, in the backward pass, the head's input gradient; the step stays exact."""
  from partitioner import roles as R
  from tests.partitioner.helpers import assert_partitioned_equal
  step, args = _lm_step("softmax")
  program = P.trace(step, *args)
  head = program.value("params/head").id
  assert R.output_heads(program, 4) == ((head, 1),)
  assert R.output_heads(program, 5) == ()                # 64 classes do not divide by 5
  pp = assert_partitioned_equal(step, args, "batch=2,model=4",
                                "BatchParallel(batch); Megatron(model)", rtol=1e-4, atol=1e-5)
  assert pp.sharding("params/head").dims == ((), ("model",))
  assert pp.sharding("params/w_in").dims == ((), ("model",))
  assert pp.sharding("params/embed").dims == ((), ())     # a table: EmbeddingSharding's
  model = [c for c in pp.collectives if c.axes == ("model",)]
  assert {c.kind for c in model} == {"all-reduce"}
  statistics = sorted(program.ops[c.op].name for c in model
                      if program.values[c.value].size == 8 * 4)
  # The maximum, the sum of exponentials, the label's logit; the backward pass's sum.
  assert statistics == ["gather", "reduce_max", "reduce_sum", "reduce_sum"]
  # The rest are activations: the MLP's row output, its and the head's input gradients.
  assert sum(program.values[c.value].shape == (8, 4, 16) for c in model) == 3 == \
      len(model) - len(statistics)
  # The head left whole (the MLP pair alone): every device computes all 64 logits.
  whole = P.apply(program, "batch=2,model=4", "BatchParallel(batch); "
                  "Tile(params/w_in, 1, model); Tile(params/w_out, 0, model)")
  from partitioner.cost import simulate
  assert simulate(pp, "h100").flops < simulate(whole, "h100").flops


def test_megatron_over_a_second_axis_leaves_a_head_whole_where_its_classes_run_out():
  """Megatron over every axis (`megatron`): 12 classes split over batch=2 do not divide by
  model=4 more, so the second leaves the head as the first split it, and says so."""
  step, args = _lm_step("softmax", vocab=12)
  program = P.trace(step, *args)
  pp = P.apply(program, "batch=2,model=4", "Megatron(batch); Megatron(model)")
  assert pp.sharding("params/head").dims == ((), ("batch",))
  notes = [n for r in pp.reports for n in r.notes]
  assert any(n.startswith("output heads left whole over model") for n in notes)


def test_megatron_leaves_a_head_whole_unless_a_softmax_reads_it():
  """A regression head (its outputs reduced by a mean of squares, no softmax) is no output
  layer over classes: left whole, as before."""
  from partitioner import roles as R
  step, args = _lm_step("squares")
  program = P.trace(step, *args)
  assert R.output_heads(program, 4) == ()
  pp = P.apply(program, "batch=2,model=4", "BatchParallel(batch); Megatron(model)")
  assert pp.sharding("params/head").dims == ((), ())


@pytest.mark.slow
def test_megatron_leaves_attention_whole_when_heads_do_not_divide():
  workload = corpus.load("gpt:small,d_model=48,heads=6")
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "model=4", "Megatron(model)")
  assert pp.sharding("params/gpt/layer_0/w_in/w").dims == ((), ("model",))
  assert pp.sharding("params/gpt/layer_0/attn/query/w").dims == ((), ())


@pytest.mark.slow
def test_zero_stages():
  workload, program = traced("mlp:small")
  w, mu = "params/mlp/layer_1/w", "opt_state/0/mu/mlp/layer_1/w"
  kinds = lambda pp: sorted({c.kind for c in pp.collectives})

  one = P.apply(program, "batch=8", "ZeRO(batch, stage=1)")
  assert one.sharding(w).dims == ((), ()) and any(one.sharding(mu).dims)
  assert one.sharding("batch/x").dims == (("batch",), ())  # ZeRO implies data parallelism
  assert kinds(one) == ["all-gather", "all-reduce"]  # gradients all-reduced, updates gathered

  two = P.apply(program, "batch=8", "ZeRO(batch, stage=2)")
  assert two.sharding(w).dims == ((), ())
  assert "reduce-scatter" in kinds(two)  # gradients reduce-scattered

  three = P.apply(program, "batch=8", "ZeRO(batch, stage=3)")
  assert three.sharding(w).dims == three.sharding(mu).dims != ((), ())
  assert three.output_shardings()["out/0/mlp/layer_1/w"].dims == three.sharding(w).dims
  assert kinds(three) == ["all-gather", "all-reduce", "reduce-scatter"]

  for pp in (one, two, three):
    spmd, jitted = run_both(pp, workload.args)
    expected = jax.tree_util.tree_leaves(workload.fn(*workload.args))
    for e, a in zip(expected, spmd):
      np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_embedding_sharding_is_vocab_parallel_and_exact():
  workload, program = traced("gpt:small")
  pp = P.apply(program, "batch=2,model=4", "BatchParallel(batch); EmbeddingSharding(model)")
  assert pp.sharding("params/gpt/embed/embeddings").dims == (("model",), ())
  # The looked-up rows are summed over the vocabulary shards; the loss's max and sum too.
  reduces = {c.reduce for c in pp.collectives if c.kind == "all-reduce" and c.axes == ("model",)}
  assert reduces == {"sum", "max"}
  expected = jax.tree_util.tree_leaves(workload.fn(*workload.args))
  for actual in run_both(pp, workload.args):
    for e, a in zip(expected, actual):
      np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4)


def test_tile_matches_globs_and_reports_its_targets():
  _, program = traced("gpt:small")
  pp = P.apply(program, "model=8", "Tile(params/gpt/layer_*/w_in/w, 1, model)")
  assert [t.name for t in pp.reports[0].targets] == ["params/gpt/layer_0/w_in/w",
                                                     "params/gpt/layer_1/w_in/w"]


def test_megatron_inside_an_earlier_zero_split_says_so_and_costs_more_flops():
  """ZeRO-3 first shards each weight along its largest dimension, the one Megatron splits
  next: nested inside the ZeRO split, the activations between the pair are not split over the
  model axis. Megatron says so; ZeRO after Megatron shards the other dimension."""
  from partitioner.cost import simulate
  _, program = traced("gpt:small")
  zero_first = P.apply(program, "batch=2,model=4",
                       "BatchParallel(batch); ZeRO(batch, stage=3); Megatron(model)")
  zero_last = P.apply(program, "batch=2,model=4",
                      "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=3)")
  said = lambda pp: [n for n in pp.reports[-1 if pp is zero_first else 1].notes
                     if "inside an earlier split over batch" in n]
  assert said(zero_first) and "params/gpt/layer_0/w_in/w" in said(zero_first)[0]
  assert not said(zero_last)
  assert simulate(zero_first, "h100").flops > 1.5 * simulate(zero_last, "h100").flops
  # Megatron over both axes nests by design (the heads split 8 ways): nothing said.
  both = P.apply(program, "batch=2,model=4", "Megatron(batch); Megatron(model)")
  assert not any("inside an earlier split" in n for r in both.reports for n in r.notes)

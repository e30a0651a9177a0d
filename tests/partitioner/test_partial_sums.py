"""Deferred partial sums: partial results meet in linear ops and are reduced once.

Each case checks the plan (which values are held, where the one all-reduce runs and its
size), both lowerings against the unpartitioned function, the collectives XLA compiles for
each lowering against the plan, and that the cost model's communication went down."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import corpus
import partitioner as P
from partitioner.collectives import ALL_REDUCE
from partitioner.cost import simulate
from partitioner.hlo import hlo_collectives
from partitioner.plan import make_plan
from partitioner.verify import verify
from tests.partitioner.helpers import assert_partitioned_equal

KEY = jax.random.PRNGKey(0)


def all_reduces(collectives):
  return sorted((c.bytes, c.axes) for c in collectives if c.kind == ALL_REDUCE)


def compiled_all_reduces(pp, args) -> dict:
  """All-reduces (tensors, bytes) of the shard_map and the jit program as XLA compiles them;
  XLA:CPU after jaxlib 0.4 combines all-reduces, so tensors are counted, not instructions."""
  mesh = pp.mesh.to_jax()
  out = {}
  for name, fn in (("shard_map", jax.jit(pp.lower_spmd(mesh))), ("jit", pp.jit(mesh))):
    found = [c for c in hlo_collectives(fn.lower(*args).compile().as_text(), pp.mesh)
             if c.kind == ALL_REDUCE and not c.from_constant]
    out[name] = (sum(c.count for c in found), sum(c.bytes for c in found))
  return out


def loop_body_all_reduces(hlo_text: str) -> int:
  """All-reduces inside while-loop bodies of compiled HLO text."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
  found, current = 0, None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
    elif " all-reduce(" in line or " all-reduce-start(" in line:
      found += current in bodies
  return found


def undeferred(pp):
  """The same shardings with every partial sum reduced by its producer."""
  twin = P.PartitionedProgram(pp.program, pp.mesh, pp.state, pp.schedule, pp.reports)
  twin.__dict__["plan"] = make_plan(pp.state, deferral=False)
  return twin


def qkv_input_gradient(x, wq, wk, wv):
  """Separate Q, K and V projections of one input: under Megatron the input's gradient is the
  sum of three partial products."""
  def f(x):
    return jnp.sum(jnp.tanh(x @ wq) * jnp.tanh(x @ wk) + jnp.tanh(x @ wv))
  return jax.grad(f)(x)


def test_three_partial_products_added_are_reduced_once():
  x = jax.random.normal(KEY, (16, 32))
  ws = [jax.random.normal(k, (32, 64)) * 0.1 for k in jax.random.split(KEY, 3)]
  pp = assert_partitioned_equal(qkv_input_gradient, (x, *ws), "model=8",
                                "Tile(wq, 1, model); Tile(wk, 1, model); Tile(wv, 1, model)")
  # The three (16, 32) products are held; one all-reduce of the sum, at the second add.
  held = pp.plan.held
  assert len(held.values) == 4 and set(held.values.values()) == {("model",)}
  names = [pp.program.ops[j].name for j in sorted(held.ops)]
  assert names == ["add_any", "add_any"]
  assert all_reduces(pp.collectives) == [(16 * 32 * 4, ("model",))]
  assert pp.collectives[0].op == max(held.ops)
  assert all_reduces(undeferred(pp).collectives) == [(16 * 32 * 4, ("model",))] * 3
  # XLA compiles exactly that: one all-reduce of 2 KiB in either lowering.
  assert compiled_all_reduces(pp, (x, *ws)) == {"shard_map": (1, 2048), "jit": (1, 2048)}
  assert simulate(pp, "h100").step_time_s < simulate(undeferred(pp), "h100").step_time_s


def tied_embedding_loss(table, tokens):
  """A weight read twice (embedding lookup and output projection): its gradient is the sum of a
  scatter-add and a matmul, both partial over the batch under data parallelism."""
  h = jnp.tanh(table[tokens])                       # (batch, seq, d)
  logits = h @ table.T                               # (batch, seq, vocab)
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1))


def test_tied_embedding_gradient_is_reduced_once_under_data_parallelism():
  table = jax.random.normal(KEY, (64, 16)) * 0.1
  tokens = jax.random.randint(KEY, (8, 4), 0, 64)
  fn = jax.grad(tied_embedding_loss)
  pp = assert_partitioned_equal(fn, (table, tokens), "batch=8", "Tile(tokens, 0, batch)")
  table_bytes = 64 * 16 * 4
  assert all_reduces(pp.collectives).count((table_bytes, ("batch",))) == 1
  assert all_reduces(undeferred(pp).collectives).count(
      (table_bytes, ("batch",))) == 2
  compiled = compiled_all_reduces(pp, (table, tokens))
  assert compiled["shard_map"] == compiled["jit"] == (
      len(all_reduces(pp.collectives)), sum(b for b, _ in all_reduces(pp.collectives)))


def test_a_sum_reduced_to_a_smaller_value_moves_its_all_reduce_there():
  """Row-parallel products summed over rows: one all-reduce of the (64,) row sum, not of the
  (32, 64) product."""
  def fn(x, w):
    return jnp.sum(x @ w, axis=0)
  x, w = jax.random.normal(KEY, (32, 16)), jax.random.normal(KEY, (16, 64))
  pp = assert_partitioned_equal(fn, (x, w), "model=8", "Tile(w, 0, model)")
  assert all_reduces(pp.collectives) == [(64 * 4, ("model",))]
  assert all_reduces(undeferred(pp).collectives) == [
      (32 * 64 * 4, ("model",))]
  assert compiled_all_reduces(pp, (x, w)) == {"shard_map": (1, 256), "jit": (1, 256)}


def test_a_sum_that_would_not_save_is_reduced_where_it_is_made():
  """One partial product carried through a transpose into a non-linear op: the all-reduce
  stays at the product, as XLA places it."""
  def fn(x, w):
    return jnp.tanh((x @ w).T)
  x, w = jax.random.normal(KEY, (32, 16)), jax.random.normal(KEY, (16, 64))
  pp = assert_partitioned_equal(fn, (x, w), "model=8", "Tile(w, 0, model)")
  assert not pp.plan.held.values
  (c,) = pp.collectives
  assert pp.program.ops[c.op].name == "dot_general"


def test_partial_operand_added_to_a_whole_one_is_not_held():
  """x @ w + b with the contraction split: b is not partial, so the product is reduced
  before the add (holding it would add b once per device)."""
  def fn(x, w, b):
    return x @ w + b
  x, w, b = (jax.random.normal(KEY, (32, 16)), jax.random.normal(KEY, (16, 64)),
             jax.random.normal(KEY, (64,)))
  pp = assert_partitioned_equal(fn, (x, w, b), "model=8", "Tile(w, 0, model)")
  assert not pp.plan.held.values


def test_sums_inside_a_loop_body_are_deferred_within_each_iteration():
  def fn(xs, w1, w2):
    def body(c, x):
      return c + jnp.tanh(x @ w1 + x @ w2), None
    return lax.scan(body, jnp.zeros((4, 32)), xs)[0]
  xs = jax.random.normal(KEY, (6, 4, 16))
  w1, w2 = (jax.random.normal(k, (16, 32)) * 0.1 for k in jax.random.split(KEY))
  program = P.trace(fn, xs, w1, w2, loops="keep")
  assert program.regions
  pp = P.apply(program, "model=8", "Tile(w1, 0, model); Tile(w2, 0, model)")
  expected = fn(xs, w1, w2)
  mesh = pp.mesh.to_jax()
  for out in (jax.jit(pp.lower_spmd(mesh))(xs, w1, w2), pp.jit(mesh)(xs, w1, w2)):
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
  (c,) = pp.collectives
  assert program.ops[c.op].name == "add" and program.region_of[c.op] >= 0
  assert len(undeferred(pp).collectives) == 2


@pytest.mark.slow
def test_megatron_gpt_backward_reduces_each_attention_input_gradient_once():
  """The corpus GPT under Megatron: Q, K and V input gradients meet before one all-reduce per
  layer, so the backward pass reduces twice per layer as Megatron-LM does, and the step's
  all-reduce traffic falls by a third; the plan stays exact and XLA compiles what it says."""
  w = corpus.load("gpt:small")
  program = P.trace(w.fn, *w.args)
  pp = P.apply(program, "model=8", "Megatron(model)")
  layers = 2
  before = all_reduces(undeferred(pp).collectives)
  after = all_reduces(pp.collectives)
  assert len(before) - len(after) == 2 * layers
  assert sum(b for b, _ in after) < 0.7 * sum(b for b, _ in before)
  compiled = compiled_all_reduces(pp, w.args)
  assert compiled["shard_map"] == compiled["jit"] == (len(after), sum(b for b, _ in after))
  assert simulate(pp, "h100").step_time_s < simulate(undeferred(pp), "h100").step_time_s


def test_a_loop_that_accumulates_partial_sums_reduces_once_after_the_loop():
  """acc = acc + sum over the batch of f(x_t), the batch split: the per-iteration all-reduce
  becomes one after the loop (the gradient of a weight a recurrence reads at every step)."""
  def fn(xs, w):
    def body(acc, x):
      return acc + jnp.sum(jnp.tanh(x * w), axis=0), None
    return lax.scan(body, jnp.zeros((16,)), xs)[0]
  xs, w = jax.random.normal(KEY, (6, 8, 16)), jax.random.normal(KEY, (16,))
  program = P.trace(fn, xs, w, loops="keep")
  pp = P.apply(program, "a=8", "Tile(xs, 1, a)")
  expected = fn(xs, w)
  mesh = pp.mesh.to_jax()
  for out in (jax.jit(pp.lower_spmd(mesh))(xs, w), pp.jit(mesh)(xs, w)):
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
  (region,) = program.regions
  assert pp.plan.held.carries == {region.exit: {0: ("a",)}}
  (c,) = pp.collectives
  assert c.op == region.exit and c.kind == ALL_REDUCE and c.bytes == 16 * 4
  (before,) = undeferred(pp).collectives
  assert program.region_of[before.op] == 0          # in the body: once per iteration
  assert compiled_all_reduces(pp, (xs, w)) == {"shard_map": (1, 64), "jit": (1, 64)}
  inside = lambda fn: loop_body_all_reduces(fn.lower(xs, w).compile().as_text())
  assert inside(jax.jit(pp.lower_spmd(mesh))) == inside(pp.jit(mesh)) == 0
  assert inside(jax.jit(undeferred(pp).lower_spmd(mesh))) == 1
  assert simulate(pp, "h100").comm_s < simulate(undeferred(pp), "h100").comm_s / 5


@pytest.mark.slow
def test_zero_keeps_a_small_loop_accumulator_whole_and_reduces_it_after_the_loop(monkeypatch):
  """ZeRO-2 shards gradients; the SSM's decay gradient, summed over time steps in a loop carry,
  stays whole over the ZeRO axes (it is small), so it is reduced once after the loop instead
  of reduce-scattered into a shard in every iteration."""
  from partitioner import tactics
  w = corpus.load("ssm:small")
  program = P.trace(w.fn, *w.args)
  schedule = corpus.experts("ssm")["zero2"]
  pp = P.apply(program, "batch=4,model=2", schedule)
  exits = set(pp.plan.held.carries)   # the backward loop of each of the two layers
  assert len(exits) == 2 and exits < {r.exit for r in program.regions}
  assert not [c for c in pp.collectives if program.region_of[c.op] >= 0]
  after = [c for c in pp.collectives if c.op in exits]
  assert len(after) == len(exits) and {c.axes for c in after} == {("batch", "model")}
  assert verify(pp, w.args).ok
  monkeypatch.setattr(tactics, "ACCUMULATOR_BYTES", 0)
  sharded = P.apply(program, "batch=4,model=2", schedule)
  assert not sharded.plan.held.carries
  inside = [c for c in sharded.collectives if program.region_of[c.op] >= 0]
  assert {c.kind for c in inside} == {"reduce-scatter"} and len(inside) == len(exits)
  assert simulate(pp, "h100").comm_s < simulate(sharded, "h100").comm_s

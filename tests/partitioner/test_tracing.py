"""Tracing into the IR: names, inlining, region ops, constants, aliases, dead code."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import corpus
import partitioner as P
from partitioner import tracing
from tests.partitioner.helpers import assert_partitioned_equal


class State(NamedTuple):
  step: jax.Array
  mu: dict


def test_inputs_are_named_by_parameter_and_pytree_path():
  def step(params, state, batch):
    return params["dense"]["w"] * state.mu["dense"] + batch[0].sum() + state.step

  params = {"dense": {"w": jnp.ones((2, 3))}}
  state = State(jnp.zeros(()), {"dense": jnp.ones((2, 3))})
  program = P.trace(step, params, state, [jnp.ones((4,)), jnp.ones((5,))])
  assert program.input_names == ("params/dense/w", "state/step", "state/mu/dense", "batch/0",
                                 "batch/1")
  assert program.output_names == ("out",)


def test_abstract_arguments_trace_without_data():
  spec = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
  program = P.trace(lambda x: (x @ x.T).sum(), spec)
  assert program.values[program.inputs[0]].shape == (4096, 8192)
  assert program.values[program.inputs[0]].dtype == jnp.bfloat16


def test_calls_are_inlined_and_evaluate_the_same():
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

  @jax.jit
  def inner(x):
    return jax.nn.relu(x) + jax.nn.gelu(x)  # custom_jvp inside a pjit

  def f(x):
    y = jax.checkpoint(lambda v: jnp.sin(v) * 2)(inner(x))
    y = jax.named_call(lambda v: v + 1, name="named")(y)
    return clip_grad(y).sum()

  x = jnp.linspace(-2, 2, 12).reshape(3, 4)
  for fn in (f, jax.grad(f)):
    program = P.trace(fn, x)
    names = set(program.primitives())
    assert not names & {"pjit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                        "checkpoint", "remat", "closed_call", "named_call"}
    # Inlined, the calls fuse otherwise; at -O0 (conftest) gelu's tanh then differs by ulps.
    np.testing.assert_allclose(program(x), fn(x), rtol=1e-5)


def test_a_differentiated_checkpoint_keeps_its_optimization_barrier(monkeypatch):
  """JAX lowers the recomputation of a `jax.checkpoint` behind an optimization barrier, so
  that XLA's CSE cannot merge it with the forward pass and keep the activations after all
  (without it XLA:GPU asked 534 GiB for gpt:1.3b at batch 16, 61 GiB with it). Inlining the
  checkpoint keeps the barrier as an op: both lowerings emit it as JAX does, the program
  computes the same, and the simulator gives it no buffer, traffic or kernel. One mesh axis
  shards all its operands (they are independent): no gathers."""
  from partitioner.cost import load_hardware, simulate
  from partitioner.cost.memory import bufferless

  def loss(w, x):
    for _ in range(2):
      x = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(x, w)
    return (x ** 2).sum()

  step = jax.grad(loss)
  w, x = jnp.eye(16) * 0.5, jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)
  program = P.trace(step, w, x)
  emitted = jax.jit(step).lower(w, x).as_text().count("optimization_barrier")
  assert program.primitives()["optimization_barrier"] == emitted == 2
  pp = assert_partitioned_equal(step, (w, x), "batch=8", "Tile(x, 0, batch)")
  assert [c.kind for c in pp.collectives] == ["all-reduce"]   # w's gradient
  mesh = pp.mesh.to_jax()
  assert pp.jit(mesh).lower(w, x).as_text().count("optimization_barrier") == 2
  assert jax.jit(pp.lower_spmd(mesh)).lower(w, x).as_text().count("optimization_barrier") == 2
  roots = bufferless(program)
  for op in program.ops:
    if op.name == "optimization_barrier":
      assert all(roots[v] == roots.get(i, i) for v, i in zip(op.outputs, op.inputs))

  monkeypatch.setattr(tracing, "_REMAT", frozenset())   # the program as traced before
  unbarred = P.apply(P.trace(step, w, x), "batch=8", "Tile(x, 0, batch)")
  assert "optimization_barrier" not in unbarred.program.primitives()
  for hardware in ("cpu", "h100"):
    with_barrier, without = simulate(pp, hardware), simulate(unbarred, hardware)
    assert with_barrier.memory.peak_bytes == without.memory.peak_bytes
    # the same time, but for kernels fused differently around it (XLA fuses nothing across
    # a barrier): here one kernel more, at most one per barrier
    launch = load_hardware(hardware).kernel_launch_s
    assert abs(with_barrier.step_time_s - without.step_time_s) <= 2 * launch + 1e-3 * \
        without.step_time_s


def test_region_ops_are_kept_whole(monkeypatch):
  monkeypatch.setattr(tracing, "UNROLL_LIMIT", 8)  # a scan of 4 steps x 2 equations is 8

  def f(x, n):
    c, ys = lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(3), x[:n])
    return lax.cond(c.sum() > 0, lambda: ys, lambda: -ys)

  x = jnp.ones((5, 3))
  program = P.trace(lambda x: f(x, 5), x)
  assert {"scan_enter", "scan_exit", "cond"} <= set(program.primitives())
  np.testing.assert_allclose(program(x), f(x, 5))
  assert "scan_enter" not in P.trace(lambda x: f(x, 4), x).primitives()


def test_short_scans_are_unrolled_and_partition_along_the_batch():
  """A recurrence over time, with its gradient (a reverse scan), becomes straight-line code;
  splitting the batch dimension of the sequence then needs no communication inside it."""
  def loss(w, xs):
    def step(h, x):
      h = jnp.tanh(h @ w + x)
      return h, h.sum(-1)
    h, ys = lax.scan(step, jnp.zeros(xs.shape[1:]), xs)
    return (h ** 2).mean() + ys.mean()

  fn = jax.value_and_grad(loss)
  w, xs = jnp.eye(16) * 0.5, jax.random.normal(jax.random.PRNGKey(0), (4, 8, 16))
  program = P.trace(fn, w, xs)
  assert not {"scan", "scan_enter"} & set(program.primitives())
  np.testing.assert_allclose(program(w, xs)[1], fn(w, xs)[1], rtol=1e-5, atol=1e-6)
  pp = assert_partitioned_equal(fn, (w, xs), "b=8", "Tile(xs, 1, b)")
  assert pp.fallbacks == {}
  assert {c.kind for c in pp.collectives} == {"all-reduce"}  # loss and gradient sums only


def test_constants_and_literals_become_constant_values():
  table = np.arange(12.0).reshape(3, 4)
  program = P.trace(lambda x: x * table + 2.0, jnp.ones((3, 4)))
  consts = [v for v in program.values if v.is_const]
  assert any(v.shape == (3, 4) for v in consts) and any(v.shape == () for v in consts)
  np.testing.assert_allclose(program(jnp.ones((3, 4))), table + 2.0)


def test_dead_code_is_dropped():
  program = P.trace(jax.grad(lambda x: jnp.sum(jnp.exp(x) ** 2)), jnp.ones(4))
  # The primal value of the loss is not an output, so its reduce_sum is gone.
  assert "reduce_sum" not in program.primitives()


def test_training_step_outputs_alias_the_state_they_update():
  workload = corpus.load("mlp:small")
  program = P.trace(workload.fn, *workload.args)
  params = [v for v, n in zip(program.inputs, program.input_names) if n.startswith("params/")]
  assert len(program.aliases) == len(program.outputs) - 1  # all but the loss
  first = program.input_names[program.aliases[0]]
  assert first.startswith("params/") and program.output_names[0].startswith("out/0/")
  assert len(params) == 6

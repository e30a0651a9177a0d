"""Running a partitioned program both ways and comparing with the original function."""

import jax
import numpy as np

import partitioner as P


def run_both(pp, args):
  """(shard_map outputs, jit outputs) as flat lists."""
  mesh = pp.mesh.to_jax()
  spmd = jax.jit(pp.lower_spmd(mesh))(*args)
  jitted = pp.jit(mesh)(*args)
  return jax.tree_util.tree_leaves(spmd), jax.tree_util.tree_leaves(jitted)


def assert_partitioned_equal(fn, args, mesh, schedule, rtol=1e-5, atol=1e-5):
  """Partitions fn(*args) and checks both lowerings against fn; returns the partitioned program."""
  program = P.trace(fn, *args)
  pp = P.apply(program, mesh, schedule)
  expected = jax.tree_util.tree_leaves(fn(*args))
  for name, actual in zip(("shard_map", "jit"), run_both(pp, args)):
    assert len(actual) == len(expected)
    for e, a in zip(expected, actual):
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                 err_msg=f"{name} lowering of {pp.strategy}")
  return pp


def momentum_step(loss_fn):
  """A training step of `loss_fn(params, batch)` with SGD and momentum: (params, momentum,
  batch) -> (params, momentum, loss), the state updated in place as a user writes it."""
  def step(params, momentum, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.01 * m, params, momentum)
    return params, momentum, loss
  return step


def kinds(pp):
  """Collective kinds and axes the plan decided, as a sorted list of (kind, axes)."""
  return sorted((c.kind, c.axes) for c in pp.collectives)

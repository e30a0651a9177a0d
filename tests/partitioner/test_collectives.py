"""Resharding: the steps chosen between two layouts, and that executing them is exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from partitioner.compat import shard_map

from partitioner import collectives as C
from partitioner.lowering import run_steps
from partitioner.mesh import Mesh
from partitioner.sharding import Sharding

SIZES = {"a": 2, "b": 4}


def steps(src, dst, partial=(), reduce="sum", shape=(8, 16)):
  return [(s.kind, s.axes, s.dim) for s in C.reshard_steps(shape, 4, src, partial, reduce, dst,
                                                           SIZES)]


def test_identity_needs_nothing():
  assert steps(((("a",)), ()), (("a",), ())) == []


def test_drop_an_axis_is_an_all_gather_add_one_is_a_free_slice():
  assert steps((("a",), ()), ((), ())) == [(C.ALL_GATHER, ("a",), 0)]
  assert steps(((), ()), ((), ("b",))) == [(C.SLICE, ("b",), 1)]
  assert steps((("a", "b"), ()), (("a",), ())) == [(C.ALL_GATHER, ("b",), 0)]


def test_moving_an_axis_between_dims_is_an_all_to_all():
  assert steps((("b",), ()), ((), ("b",))) == [(C.ALL_TO_ALL, ("b",), 0)]


def test_partial_becomes_reduce_scatter_where_the_target_tiles_and_all_reduce_otherwise():
  assert steps(((), ()), (("b",), ()), partial=("b",)) == [(C.REDUCE_SCATTER, ("b",), 0)]
  assert steps(((), ()), ((), ()), partial=("a", "b")) == [(C.ALL_REDUCE, ("a", "b"), -1)]
  assert steps(((), ()), ((), ()), partial=("a",), reduce="max") == [(C.ALL_REDUCE, ("a",), -1)]


def test_bytes_count_the_larger_side():
  s = C.reshard_steps((8, 16), 4, (("b",), ()), (), "sum", ((), ()), SIZES)
  assert s[0].bytes == 8 * 16 * 4  # all-gather: its output
  s = C.reshard_steps((8, 16), 4, ((), ()), ("b",), "sum", (("b",), ()), SIZES)
  assert s[0].bytes == 8 * 16 * 4  # reduce-scatter: its input


@pytest.mark.parametrize("src,partial,reduce,dst", [
    ((("a",), ("b",)), (), "sum", (("b",), ("a",))),
    ((("a", "b"), ()), (), "sum", ((), ("b", "a"))),
    (((), ()), ("a",), "sum", (("a",), ("b",))),
    (((), ("b",)), ("a",), "max", ((), ("b", "a"))),
    ((("b",), ()), ("a",), "min", ((), ())),
    (((), ("a",)), (), "sum", (("b",), ("a",))),
])
def test_executed_steps_produce_the_target_layout(src, partial, reduce, dst):
  mesh = Mesh({"a": 2, "b": 4}).to_jax()
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  plan = C.reshard_steps(x.shape, 4, src, partial, reduce, dst, SIZES)

  def body(local):
    if partial:  # make the piece partial: one device of each group holds x, the others 0.
      first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in partial]))
      fill = {"sum": 0.0, "max": -1e9, "min": 1e9}[reduce]
      local = jnp.where(first, local, fill)
    return run_steps(local, plan, SIZES)

  f = shard_map(body, mesh=mesh, in_specs=Sharding(src).spec(), out_specs=Sharding(dst).spec())
  np.testing.assert_array_equal(jax.jit(f)(x), x)

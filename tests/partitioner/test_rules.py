"""Every rule family, partitioned and run on 8 CPU devices against the unpartitioned function.

Each case tiles inputs with `Tile` (and propagation does the rest), runs the explicit shard_map
program and the jit program, and pins the collectives the plan decided.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import partitioner as P
from partitioner import tracing
from tests.partitioner.helpers import assert_partitioned_equal, kinds

KEY = jax.random.PRNGKey(0)


def rand(*shape, dtype=jnp.float32, key=0):
  return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def ints(*shape, high=8, key=1):
  return jax.random.randint(jax.random.PRNGKey(key), shape, 0, high)


AR = "all-reduce"
AG = "all-gather"
RS = "reduce-scatter"
A2A = "all-to-all"

CASES = [
    # name, fn, args, mesh, schedule, expected collectives (None: not pinned)
    ("elementwise_broadcast", lambda x, b: jnp.tanh(x * 2.0) + b[None, :] ** 2,
     (rand(8, 16), rand(16)), "a=8", "Tile(x, 0, a)", []),
    ("elementwise_size1_dims", lambda x, s: jnp.where(x > 0, x, s) - jnp.exp(s),
     (rand(8, 16, 4), rand(8, 16, 1)), "a=2,b=4", "Tile(x, 0, a); Tile(x, 1, b)", []),
    ("select_clamp_convert", lambda x: lax.clamp(-0.5, x, 0.5).astype(jnp.float16).astype(
        jnp.float32) + lax.integer_pow(x, 3), (rand(16, 8),), "a=8", "Tile(x, 0, a)", []),
    ("dot_batch_and_free", lambda x, w: jnp.einsum("bsd,df->bsf", x, w),
     (rand(8, 4, 16), rand(16, 32)), "a=2,b=4", "Tile(x, 0, a); Tile(w, 1, b)", []),
    ("dot_contracting_partial", lambda x, w: x @ w, (rand(8, 16), rand(16, 4)), "a=8",
     "Tile(x, 1, a)", [(AR, ("a",))]),
    ("dot_contracting_reduce_scatter", lambda x, w: x @ w, (rand(8, 16), rand(16, 8)), "a=8",
     "Tile(x, 1, a); Tile(out, 0, a)", [(RS, ("a",))]),
    ("dot_general_batch_dims", lambda q, k: jnp.einsum("bhsd,bhtd->bhst", q, k),
     (rand(2, 8, 4, 4), rand(2, 8, 4, 4)), "a=2,b=4", "Tile(q, 0, a); Tile(k, 1, b)", []),
    ("reduce_sum_partial", lambda x: jnp.sum(x, axis=1), (rand(4, 16),), "a=8", "Tile(x, 1, a)",
     [(AR, ("a",))]),
    ("reduce_max_min_partial", lambda x: (jnp.max(x, axis=0), jnp.min(x, axis=0)),
     (rand(16, 4),), "a=8", "Tile(x, 0, a)", [(AR, ("a",)), (AR, ("a",))]),
    ("softmax_over_sharded_axis", lambda x: jax.nn.softmax(x, axis=-1), (rand(4, 32),), "a=8",
     "Tile(x, 1, a)", None),
    ("argmax_needs_whole_axis", lambda x: jnp.argmax(x, axis=1), (rand(4, 16),), "a=8",
     "Tile(x, 1, a)", [(AG, ("a",))]),
    ("reshape_split_major", lambda x: x.reshape(8, 4, 4) * 2, (rand(8, 16),), "a=4",
     "Tile(x, 1, a)", []),
    ("reshape_merge", lambda x: x.reshape(8, 16) + 1, (rand(8, 4, 4),), "a=2,b=4",
     "Tile(x, 1, b); Tile(x, 0, a)", []),
    ("reshape_merge_two_axes", lambda x: x.reshape(32, 4).sum(0),
     (rand(4, 8, 4),), "a=2,b=4", "Tile(x, 0, b); Tile(x, 1, a)", [(AR, ("b", "a"))]),
    ("reshape_indivisible_gathers", lambda x: x.reshape(6, 8), (rand(4, 12),), "a=4",
     "Tile(x, 1, a)", [(AG, ("a",))]),
    ("transpose_squeeze_expand", lambda x: jnp.squeeze(x, 1).T[None] * 3, (rand(8, 1, 16),),
     "a=2,b=4", "Tile(x, 0, a); Tile(x, 2, b)", []),
    ("broadcast_in_dim", lambda v: jnp.broadcast_to(v[:, None], (16, 8)) + 1, (rand(16),),
     "a=8", "Tile(v, 0, a)", []),
    ("concatenate_other_dim", lambda x, y: jnp.concatenate([x, y], axis=1), (rand(8, 4),
                                                                            rand(8, 2)), "a=8",
     "Tile(x, 0, a)", []),
    ("concatenate_on_sharded_dim", lambda x, y: jnp.concatenate([x, y], axis=0),
     (rand(8, 4), rand(8, 4)), "a=8", "Tile(x, 0, a); Tile(y, 0, a)", [(AG, ("a",)),
                                                                        (AG, ("a",))]),
    ("slice_pad_whole_dims", lambda x: jnp.pad(x[:, 1:3], ((0, 0), (1, 1))), (rand(16, 4),),
     "a=8", "Tile(x, 0, a)", []),
    ("dynamic_slice_and_update", lambda x, i: lax.dynamic_update_slice(
        x, lax.dynamic_slice(x, (0, i), (16, 2)) * 2, (0, i + 1)), (rand(16, 8), jnp.int32(3)),
     "a=8", "Tile(x, 0, a)", []),
    ("iota_sharded", lambda x: x + lax.broadcasted_iota(jnp.float32, (8, 16), 1), (rand(8, 16),),
     "a=8", "Tile(x, 1, a)", []),
    ("cumsum_other_axis", lambda x: jnp.cumsum(x, axis=1), (rand(8, 16),), "a=8",
     "Tile(x, 0, a)", []),
    ("cumsum_sharded_axis", lambda x: jnp.cumsum(x, axis=1), (rand(8, 16),), "a=8",
     "Tile(x, 1, a)", [(AG, ("a",))]),
    ("sort_and_top_k", lambda x: (jnp.sort(x, axis=1), lax.top_k(x, 3)[0]), (rand(8, 16),),
     "a=8", "Tile(x, 0, a)", []),
    ("embedding_lookup_vocab_sharded", lambda t, i: jnp.take(t, i, axis=0),
     (rand(64, 8), ints(4, 6, high=64)), "a=8", "Tile(t, 0, a)", [(AR, ("a",))]),
    ("embedding_lookup_batch_sharded", lambda t, i: t[i], (rand(64, 8), ints(8, 6, high=64)),
     "a=8", "Tile(i, 0, a)", []),
    ("embedding_lookup_fill_mode", lambda t, i: jnp.take(t, i, axis=0, mode="fill",
                                                         fill_value=-1.0),
     (rand(16, 4), jnp.array([[0, 3, 15, 16, -1, 40]], jnp.int32)), "a=8", "Tile(t, 0, a)",
     [(AR, ("a",))]),
    ("embedding_gradient", jax.grad(lambda t, i: jnp.sum(jnp.take(t, i, axis=0) ** 2)),
     (rand(64, 8), ints(8, 6, high=64)), "a=2,b=4", "Tile(t, 0, b); Tile(i, 0, a)",
     None),
    ("take_along_axis_parallel", lambda l, y: jnp.take_along_axis(l, y[..., None], axis=-1),
     (rand(8, 4, 16), ints(8, 4, high=16)), "a=8", "Tile(l, 0, a)", []),
    ("take_along_axis_vocab", lambda l, y: jnp.take_along_axis(l, y[..., None], axis=-1),
     (rand(8, 4, 16), ints(8, 4, high=16)), "a=2,b=4", "Tile(l, 0, a); Tile(l, 2, b)",
     [(AR, ("b",))]),
    ("cross_entropy_gradient", jax.grad(
        lambda l, y: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(l), y[..., None], -1))),
     (rand(8, 4, 16), ints(8, 4, high=16)), "a=2,b=4", "Tile(l, 0, a); Tile(l, 2, b)", None),
    ("conv_batch_and_features", lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     (rand(8, 6, 6, 4), rand(3, 3, 4, 8)), "a=2,b=4", "Tile(x, 0, a); Tile(w, 3, b)", []),
    ("conv_input_features_partial", lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
     (rand(2, 6, 6, 8), rand(3, 3, 8, 4)), "a=8", "Tile(x, 3, a)", [(AR, ("a",))]),
    ("conv_gradients", jax.grad(lambda x, w: jnp.sum(jnp.tanh(lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))), argnums=(0, 1)),
     (rand(8, 6, 6, 4), rand(3, 3, 4, 8)), "a=8", "Tile(x, 0, a)", None),
    ("max_pool_batch", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1),
                                                   (1, 2, 2, 1), "VALID"),
     (rand(8, 4, 4, 2),), "a=8", "Tile(x, 0, a)", []),
    ("max_pool_gradient", jax.grad(lambda x: jnp.sum(lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"))), (rand(8, 4, 4, 2),),
     "a=8", "Tile(x, 0, a)", []),
    ("custom_jvp_vjp_remat_inlined", jax.grad(lambda x: jnp.sum(jax.checkpoint(
        lambda y: jax.nn.relu(y) * jax.nn.gelu(y))(x) + jax.nn.softplus(x))), (rand(16, 4),),
     "a=8", "Tile(x, 0, a)", []),
]


@pytest.mark.parametrize("name,fn,args,mesh,schedule,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_rule_partitions_correctly(name, fn, args, mesh, schedule, expected):
  # Name the inputs after the lambda's parameters.
  pp = assert_partitioned_equal(fn, args, mesh, schedule)
  if expected is not None:
    assert kinds(pp) == sorted(expected)


def test_clip_mode_lookup_from_sharded_table_clamps_like_the_original():
  """Out-of-range indices of a clip-mode gather read the edge rows. The shard_map lowering
  clamps before masking and is exact. XLA's own SPMD partitioner (jaxlib 0.4.34; fixed by 0.10.2)
  returns zeros for them even from a plain jit with a sharded input; the jit lowering runs gathers as the
  plan does (a one-op shard_map island), so it is exact too."""
  from tests.partitioner.helpers import run_both
  table = jnp.arange(64.0).reshape(16, 4)
  index = jnp.array([[0, 3, 15, 16, -1, 40]], jnp.int32)
  f = lambda t, i: jnp.take(t, i, axis=0, mode="clip")
  pp = P.apply(P.trace(f, table, index), "a=8", "Tile(t, 0, a)")
  spmd, jitted = run_both(pp, (table, index))
  np.testing.assert_array_equal(spmd[0], f(table, index))
  assert kinds(pp) == [(AR, ("a",))]
  np.testing.assert_array_equal(jitted[0], f(table, index))
  plain = jax.jit(f, in_shardings=(NamedSharding(pp.mesh.to_jax(), PartitionSpec("a")), None))
  xla = np.asarray(plain(table, index))[0, :, 0].tolist()
  # jaxlib 0.4.34's answer (zeros where rows are clamped); 0.10.2's is right.
  assert xla in ([0.0, 12.0, 60.0, 0.0, 0.0, 0.0], np.asarray(f(table, index))[0, :, 0].tolist())


def test_tile_outputs_by_name():
  """`out` names the output of a single-output function, so tactics can shard results."""
  pp = assert_partitioned_equal(lambda x, w: x @ w, (rand(8, 16), rand(16, 8)), "a=8",
                                "Tile(out, 1, a)")
  assert pp.output_shardings()["out"].dims == ((), ("a",))


def test_while_and_cond_fall_back_to_replicated_and_stay_correct(monkeypatch):
  """A scan kept as a loop partitions its body (tests/partitioner/test_loops.py); `while` and
  `cond` keep their bodies whole and run replicated."""
  monkeypatch.setattr(tracing, "UNROLL_LIMIT", 0)  # keep the scan a loop

  def f(x):
    carry, ys = lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(x.shape[1:]), x)
    z = lax.while_loop(lambda v: v[0] < 3, lambda v: (v[0] + 1, v[1] * 1.5), (0, carry))[1]
    return lax.cond(z.sum() > 0, lambda: ys * 2, lambda: ys - 1) + z

  pp = assert_partitioned_equal(f, (rand(4, 16),), "a=8", "Tile(x, 1, a)")
  assert len(pp.program.regions) == 1
  reasons = {pp.program.ops[i].name: r for i, r in pp.fallbacks.items()}
  assert set(reasons) == {"while", "cond"}
  assert all("runs replicated: its body is not partitioned yet" in r for r in reasons.values())
  assert (AG, ("a",)) in kinds(pp)  # the while loop needs the carry whole


def test_unknown_primitive_runs_replicated_and_is_reported():
  def f(x):
    return jnp.linalg.cholesky(x @ x.T + 16 * jnp.eye(8)) * 2

  pp = assert_partitioned_equal(f, (rand(8, 8),), "a=8", "Tile(x, 0, a)", atol=1e-4)
  assert "cholesky" in {pp.program.ops[i].name for i in pp.fallbacks}


def test_gather_parallel_dims_are_detected_from_iota_indices():
  def f(l, y):
    return jnp.take_along_axis(l, y[..., None], axis=-1)

  program = P.trace(f, rand(8, 4, 16), ints(8, 4, high=16))
  from partitioner.propagation import factor_table
  from partitioner.factors import PASS, SUM
  gather = next(op for op in program.ops if op.name == "gather")
  fac = factor_table(program)[gather.index].factors
  operand_kinds = [fac.kinds[d[0]] for d in fac.operands[0]]
  assert operand_kinds == [PASS, PASS, SUM]
  index_factors = {f for d in fac.operands[1] for f in d}
  assert fac.operands[0][0][0] in index_factors and fac.operands[0][1][0] in index_factors

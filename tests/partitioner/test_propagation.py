"""Propagation: both directions to a fixed point, priorities, conflicts, monotonicity, origins."""

import jax
import jax.numpy as jnp
import pytest

import partitioner as P
from partitioner.errors import MeshError, PatternError, ShardingError
from partitioner.propagation import ShardingState, factor_table


def rand(*shape):
  return jax.random.normal(jax.random.PRNGKey(0), shape)


def mlp(x, w1, w2):
  return jnp.tanh(jax.nn.relu(x @ w1) @ w2)


ARGS = (rand(8, 16), rand(16, 32), rand(32, 4))


def test_forward_and_backward_to_a_fixed_point():
  program = P.trace(mlp, *ARGS)
  # Tiling the output's rows reaches the input's rows backwards through every op.
  pp = P.apply(program, "a=8", "Tile(out, 0, a)")
  assert pp.sharding("x").dims == (("a",), ())
  assert pp.sharding("w1").dims == ((), ())
  # Tiling w1's columns reaches w2's rows through relu and the contracting factor.
  pp = P.apply(program, "a=8", "Tile(w1, 1, a)")
  assert pp.sharding("w2").dims == (("a",), ())
  assert [c.kind for c in pp.collectives] == ["all-reduce"]


def test_earlier_tactics_win_and_the_conflict_names_values_and_axes():
  program = P.trace(mlp, *ARGS)
  pp = P.apply(program, "a=8", "Tile(x, 0, a); Tile(w1, 0, a)")
  assert pp.sharding("x").dims == (("a",), ())
  assert pp.sharding("w1").dims == (("a",), ())
  [conflict] = [c for c in pp.conflicts if c.primitive == "dot_general"]
  assert "on a" in conflict.kept and "w1 on a" in conflict.dropped
  assert conflict.tactic == 1
  # The loser is resharded: w1 is all-gathered for the product.
  assert [(c.kind, program.name(c.value)) for c in pp.collectives][0] == ("all-gather", "w1")


def test_a_later_tactic_never_undoes_an_earlier_one():
  program = P.trace(mlp, *ARGS)
  with pytest.raises(ShardingError, match=r"x is already sharded over 'a' on dimension 0 by tactic #0"):
    P.apply(program, "a=8", "Tile(x, 0, a); Tile(x, 1, a)")
  with pytest.raises(ShardingError, match="cannot keep it replicated over 'a'"):
    P.apply(program, "a=8", "Tile(x, 0, a); Replicate(x)")
  # Refining the same dimension with a second axis is fine.
  pp = P.apply(program, "a=2,b=4", "Tile(x, 0, a); Tile(x, 0, b)")
  assert pp.sharding("x").dims == (("a", "b"), ())


def test_replicate_stops_propagation():
  program = P.trace(mlp, *ARGS)
  pp = P.apply(program, "a=8", "Replicate(w2); Tile(w1, 1, a)")
  # w2 stays stored whole; the product reads a free local slice of it and is then summed.
  assert pp.sharding("w2").dims == ((), ())
  assert [c.kind for c in pp.collectives] == ["all-reduce"]
  pp = P.apply(program, "a=8", "Tile(w1, 1, a)")
  assert pp.sharding("w2").dims == (("a",), ())


def test_propagation_is_incremental():
  def two_chains(x, y):
    return jnp.tanh(x) * 2 + 1, jnp.exp(y) @ y.T

  program = P.trace(two_chains, rand(8, 8), rand(8, 8))
  pp = P.apply(program, "a=8", "Tile(x, 0, a)")
  chain_x = sum(1 for op in program.ops if any(program.name(v).startswith("out/0")
                                               for v in op.outputs)) + 3
  assert pp.reports[0].visits <= chain_x
  assert pp.sharding("y").dims == ((), ())


def test_why_tells_the_origin_of_each_axis():
  program = P.trace(mlp, *ARGS)
  pp = P.apply(program, "a=8", "Tile(x, 0, a)")
  assert pp.why("x") == ["dim 0 on 'a': tactic #0, set directly"]
  assert pp.why("out")[0].startswith("dim 0 on 'a': tactic #0, propagated through op #")


def test_bad_input_errors():
  program = P.trace(mlp, *ARGS)
  with pytest.raises(MeshError, match="unknown mesh axis 'c'; the mesh has a"):
    P.apply(program, "a=8", "Tile(x, 0, c)")
  with pytest.raises(ShardingError, match=r"w2: dimension 1 of size 4 is not divisible by a=8"):
    P.apply(program, "a=8", "Tile(w2, 1, a)")
  with pytest.raises(ShardingError, match="has rank 2; dimension 2 does not exist"):
    P.apply(program, "a=8", "Tile(x, 2, a)")
  with pytest.raises(PatternError, match="matches no input or output"):
    P.apply(program, "a=8", "Tile(params/**, 0, a)")
  with pytest.raises(MeshError, match="bad mesh"):
    P.apply(program, "a=eight", "Tile(x, 0, a)")


def test_state_copies_are_independent():
  program = P.trace(mlp, *ARGS)
  base = P.apply(program, "a=2,b=4", "Tile(x, 0, a)")
  left = base.apply("Tile(w1, 1, b)")
  right = base.apply("Tile(w1, 0, b)")
  assert left.sharding("w1").dims == ((), ("b",))
  assert right.sharding("w1").dims == (("b",), ())
  assert base.sharding("w1").dims == ((), ())
  assert len(left.schedule) == len(right.schedule) == 2


def two_layers(x, w1, w2):
  return jnp.tanh(jnp.tanh(x @ w1) @ w2)


LAYER_ARGS = (rand(8, 16), rand(16, 16), rand(16, 16))


def test_ops_alike_share_remembered_outcomes_that_name_their_own_values():
  program = P.trace(two_layers, *LAYER_ARGS)
  table = factor_table(program)
  dots = [op.index for op in program.ops if op.name == "dot_general"]
  forward = dots   # x @ w1 and h @ w2: one class, the outcome of one is replayed for both
  assert table[forward[0]].klass == table[forward[1]].klass
  P.apply(program, "a=2,b=2", "Tile(w2, 1, b); Tile(x, 1, a)")   # warms the memo
  schedule = "Tile(x, 0, a); Tile(w1, 0, a); Tile(w2, 0, a); Tile(w1, 1, b)"
  warm = P.apply(program, "a=2,b=2", schedule)
  cold = P.apply(P.trace(two_layers, *LAYER_ARGS), "a=2,b=2", schedule)
  assert warm.state.dims == cold.state.dims
  assert warm.state.origin == cold.state.origin
  assert warm.conflicts == cold.conflicts
  assert warm.collectives == cold.collectives
  # Each weight's conflict with the batch axis is reported at its own matmul.
  dropped = {c.dropped for c in warm.conflicts if c.op in forward}
  assert dropped == {"w1 on a", "w2 on a"}


def with_branch(x, w1, w2, y):
  return two_layers(x, w1, w2), jnp.tanh(y)


def test_outcomes_are_shared_by_schedules_whose_priorities_differ_only_in_numbering(monkeypatch):
  args = LAYER_ARGS + (rand(8, 4),)
  program = P.trace(with_branch, *args)
  P.apply(program, "a=2,b=2", "Tile(x, 0, a); Tile(w1, 1, b)")   # phases 0 and 1
  computed = []
  transfer = ShardingState._transfer
  monkeypatch.setattr(ShardingState, "_transfer",
                      lambda self, index: computed.append(index) or transfer(self, index))
  # An unrelated first tactic: the same two tactics run as phases 1 and 2.
  schedule = "Tile(y, 0, a); Tile(x, 0, a); Tile(w1, 1, b)"
  shifted = P.apply(program, "a=2,b=2", schedule)
  branch = {op.index for op in program.ops if op.name == "tanh" and
            program.ops[op.index].inputs[0] == program.value("y").id}
  assert computed and set(computed) <= branch
  monkeypatch.setattr(ShardingState, "_transfer", transfer)
  cold = P.apply(P.trace(with_branch, *args), "a=2,b=2", schedule)
  assert shifted.state.dims == cold.state.dims
  assert shifted.collectives == cold.collectives


def test_can_tile_says_what_tile_would_raise_and_refuses_no_ops():
  """The legality check the environment masks tile actions by is the partitioner's own: it
  gives the message `tile` raises, and a tile that would change nothing is refused too."""
  program = P.trace(mlp, *ARGS)
  state = P.apply(program, "a=8", "Tile(x, 0, a)").state.copy()
  x, w2 = program.value("x").id, program.value("w2").id
  for vid, dim in ((x, 1), (w2, 1), (x, 2)):
    why = state.can_tile(vid, dim, ("a",))
    with pytest.raises(ShardingError) as e:
      state.copy().tile(vid, dim, ("a",), 1)
    assert why == str(e.value)
  assert "already sharded over 'a' on dimension 0" in state.can_tile(x, 0, ("a",))
  assert not state.copy().tile(x, 0, ("a",), 1)
  assert state.can_tile(w2, 0, ("a",)) is None and state.copy().tile(w2, 0, ("a",), 1)
  state.forbid(w2, ("a",), 1)
  assert state.can_tile(w2, 0, ("a",)) == "an earlier tactic keeps w2 replicated over 'a'"

"""Attention heads padded to divide over an axis (`HeadPadding`, `heads.pad_heads`): 6 heads
over 4 devices are held as 8, zero ones added, so that Megatron splits the attention instead of
leaving it whole; both lowerings stay exact against the user's program, the collectives are
those of an attention whose heads divide, and the padding's work is priced."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner as P
from partitioner.cost import simulate
from partitioner.errors import ScheduleError, ShardzeroError
from partitioner.heads import pad_heads
from partitioner.layouts import Interleaved, Padded
from partitioner.roles import megatron_pairs
from partitioner.verify import verify
from tests.partitioner.helpers import momentum_step

B, T, W = 8, 8, 8   # batch, sequence, head width
MESH = "batch=2,model=4"
DP_MEGATRON = "BatchParallel(batch); Megatron(model)"


def _step(heads: int, fused: bool = False, kv_heads: int | None = None):
  """A pre-norm-free attention block and MLP trained with momentum; `fused`: q, k and v from one
  matmul split three ways (HF GPT-2's `c_attn`); `kv_heads`: grouped keys and values."""
  d = heads * W
  kv = kv_heads or heads

  def loss_fn(p, x):
    split = lambda y, n: y.reshape(*y.shape[:2], n, W)
    if fused:
      q, k, v = jnp.split(x @ p["qkv"] + p["b"], 3, axis=-1)
    else:
      q, k, v = x @ p["q"] + p["b"], x @ p["k"], x @ p["v"]
    q, k, v = split(q, heads), split(k, kv), split(v, kv)
    k, v = (jnp.repeat(y, heads // kv, axis=2) for y in (k, v))
    a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(W), -1)
    h = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(x.shape) @ p["o"]
    h = h + jax.nn.relu(h @ p["w1"]) @ p["w2"]
    return jnp.mean(h ** 2)

  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  params = {"o": f32(d, d), "w1": f32(d, 4 * d), "w2": f32(4 * d, d)}
  if fused:
    params.update(qkv=f32(d, 3 * d), b=f32(3 * d))
  else:
    params.update(q=f32(d, d), b=f32(d), k=f32(d, kv * W), v=f32(d, kv * W))
  return momentum_step(loss_fn), (params, params, f32(B, T, d))


def _counts(pp):
  return collections.Counter((c.kind, c.axes) for c in pp.collectives)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_heads_that_do_not_divide_are_padded_and_megatron_splits_them(fused):
  step, args = _step(6, fused)
  program = P.trace(step, *args)
  padded = pad_heads(program, 4)
  layouts = {padded.input_names[k]: lay for k, lay in padded.layouts.items()}
  if fused:   # each chunk padded, then interleaved
    assert layouts["params/qkv"] == Interleaved(1, 3, 144, 192)
  else:
    assert layouts["params/q"] == Padded(1, 48, 64, W) == layouts["momentum/k"]
  assert layouts["params/o"] == Padded(0, 48, 64, W)
  assert "params/w1" not in layouts and "params/w2" not in layouts
  column = "params/qkv" if fused else "params/q"
  pairs = lambda p: {p.name(x.column): {p.name(r[0]) for r in x.rows}
                     for x in megatron_pairs(p, 4)}
  assert pairs(padded)[column] == {"params/o"}
  assert column not in pairs(program)   # 6 heads do not split 4 ways

  pp = P.apply(program, MESH, "HeadPadding(model); " + DP_MEGATRON)
  assert pp.program is padded
  assert "6 -> 8" in pp.reports[0].notes[0]
  # The collectives of an attention whose 8 heads divide: two all-reduces of activations over
  # `model` forward and two backward, the gradients' over `batch`; no gather of a head.
  step8, args8 = _step(8, fused)
  assert _counts(pp) == _counts(P.apply(P.trace(step8, *args8), MESH, DP_MEGATRON))
  assert not [c for c in pp.collectives if c.kind == "all-gather"]
  for schedule in (DP_MEGATRON, "ZeRO(batch, stage=3); Megatron(model)"):
    result = verify(P.apply(program, MESH, "HeadPadding(model); " + schedule), args)
    assert result.ok, f"{schedule}: max error {result.max_abs_err} in {result.worst}"


def test_grouped_key_value_heads_that_do_not_divide_leave_them_whole_and_stay_exact():
  step, args = _step(6, kv_heads=2)
  program = P.trace(step, *args)
  pp = P.apply(program, MESH, "HeadPadding(model); " + DP_MEGATRON)
  names = {pp.program.input_names[k] for k in pp.program.layouts}
  assert "params/q" in names and "params/k" not in names and "params/v" not in names
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_keys_and_values_are_not_padded_where_it_would_pad_query_heads_that_divide():
  # 2 key/value heads over 4 devices, each repeated for 4 of the 8 query heads: padding them
  # to 4 would pad the queries to 16 (Megatron-LM replicates such keys and values instead).
  step, args = _step(8, kv_heads=2)
  program = P.trace(step, *args)
  assert pad_heads(program, 4) is program
  result = verify(P.apply(program, MESH, "HeadPadding(model); " + DP_MEGATRON), args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_the_padding_is_priced_and_pays_where_megatron_splits_the_heads():
  step, args = _step(6)
  program = P.trace(step, *args)
  cost = lambda schedule: simulate(P.apply(program, MESH, schedule), "h100")
  # Eight heads' work where six would do: more work on one device...
  assert cost("BatchParallel(batch)").flops < cost("HeadPadding(model); BatchParallel(batch)").flops
  # ...and less on each of four, where the user's six heads stay whole on every device.
  assert cost("HeadPadding(model); " + DP_MEGATRON).flops < 0.8 * cost(DP_MEGATRON).flops


def test_nothing_is_padded_where_the_heads_divide():
  step, args = _step(8)
  program = P.trace(step, *args)
  pp = P.apply(program, MESH, "HeadPadding(model); " + DP_MEGATRON)
  assert pp.program is program and pp.program.layouts == program.layouts
  assert pp.reports[0].notes[0].startswith("nothing padded")


def test_padded_heads_are_cut_into_micro_batches_and_verify():
  """`Microbatch` traces the step again at a micro-batch's size: padded again, op for op."""
  step, args = _step(6)
  program = P.trace(step, *args)
  pp = P.apply(program, MESH, "HeadPadding(model); Microbatch(2); " + DP_MEGATRON)
  assert pp.program.microbatches == 2 and pp.program.layouts == pad_heads(program, 4).layouts
  assert [r.tactic for r in pp.reports][:2] == ["HeadPadding(model)", "Microbatch(2)"]
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_head_padding_comes_first_and_names_an_axis_of_the_mesh():
  step, args = _step(6)
  program = P.trace(step, *args)
  with pytest.raises(ScheduleError, match="put it first"):
    P.apply(program, MESH, "BatchParallel(batch); HeadPadding(model)")
  with pytest.raises(ScheduleError, match="before Microbatch"):
    P.apply(program, MESH, "Microbatch(2); HeadPadding(model)")
  with pytest.raises(ScheduleError, match="heads are padded"):
    P.apply(program, MESH, "HeadPadding(model); Pipeline(batch, microbatches=2)")
  with pytest.raises(ShardzeroError, match="tensor"):
    P.apply(program, MESH, "HeadPadding(tensor)")


def test_an_hf_gpt2_whose_fused_heads_do_not_divide_is_padded_and_verifies():
  import corpus
  workload = corpus.load("hf_gpt2:small,heads=6,d_model=96")
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, MESH, "HeadPadding(model); " + DP_MEGATRON)
  kernel = pp.program.layouts[pp.program.input_names.index(
      "params/transformer/h/0/attn/c_attn/kernel")]
  assert kernel.padded == 3 * 128   # 6 heads of 16 to 8, in each of q, k and v
  result = verify(pp, workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"

"""`Remat()`: the forward pass's activations computed again in the backward pass from the
values at its narrowest cuts. Exact against the user's step under both lowerings and composed
with other tactics; smaller peaks for about one more forward pass of work; kept by XLA (its
CSE does not merge the recomputation back); refused in one line where it cannot apply."""

import jax
import jax.numpy as jnp
import pytest

import corpus
import partitioner as P
from partitioner.cost import simulate
from partitioner.verify import verify

SLOW = pytest.mark.slow   # on the pinned stack only: one case runs on both


@pytest.mark.parametrize("model, schedule", [
    ("gpt:small", "Remat(); BatchParallel(batch); Megatron(model)"),
    pytest.param("hf_gpt2:small", "Remat(); BatchParallel(batch); ZeRO(model)", marks=SLOW),
    pytest.param("hf_t5:small", "Remat(); BatchParallel(batch); Megatron(model)", marks=SLOW),
    pytest.param("gpt:small", "Remat(); Microbatch(2); BatchParallel(batch); Megatron(model); "
                 "ZeRO(batch)", marks=SLOW),
])
def test_a_recomputed_step_verifies_under_both_lowerings_with_other_tactics(model, schedule):
  workload = corpus.load(model)
  pp = P.apply(P.trace(workload.fn, *workload.args), "batch=2,model=4", schedule)
  rewritten = pp.program if "Microbatch" not in schedule else pp.program.original
  assert rewritten.recomputation.segments > 0
  assert pp.program.microbatches == (2 if "Microbatch" in schedule else 1)
  result = verify(pp, workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_activations_shrink_for_about_one_more_forward_pass_of_work():
  workload = corpus.load("gpt:mini,batch=32,layers=4", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  plain = P.apply(program, "batch=8", "BatchParallel(batch)")
  again = P.apply(program, "batch=8", "Remat(); BatchParallel(batch)")
  r = again.program.recomputation
  # The residual stream between blocks is kept, the rest computed again.
  assert r.kept_bytes < 0.25 * r.activation_bytes < r.recomputed_bytes
  assert 2 * 4 <= len(r.bounds) + 1 and r.segments >= 4
  a, b = simulate(plain, "h100"), simulate(again, "h100")
  assert b.peak_memory_bytes < 0.8 * a.peak_memory_bytes
  # A forward pass is about a third of a step's matmul work; the last segment (the vocabulary
  # head, a large share at this size, and the loss) is not computed again.
  assert 1.05 < b.flops / a.flops < 1.34
  assert b.step_time_s > a.step_time_s
  # Gradients are what they were: reduced once, the same bytes.
  grads = lambda pp: sorted(c.bytes for c in pp.collectives if c.kind == "all-reduce")
  assert grads(plain) == grads(again)


@pytest.mark.parametrize("model", ["hf_gpt2:small,batch=32,seq=128", "hf_llama:small",
                                   "hf_bert:small", "bert:small"])
def test_the_backward_pass_is_found_whatever_else_starts_from_one(model):
  """The gradient's seed is an op reading the constant 1.0. So are per-token broadcasts of 1.0
  that only derivatives read, made in the forward pass of HF's models with LayerNorm, which
  start parts of the backward pass (taking the one that starts the fewest, `Remat` found no
  cut in HF GPT-2 at 128 tokens); and the corpus BERT's loss is a mean over the tokens its
  mask keeps, so its seed, `1.0 / count`, reads the data too (no seed was found)."""
  workload = corpus.load(model, abstract=True)
  program = P.trace(workload.fn, *workload.args)
  r = P.apply(program, "batch=8", "Remat(); BatchParallel(batch)").program.recomputation
  assert r.kept_bytes < 0.1 * r.activation_bytes and r.segments >= 3
  assert r.recomputed_bytes > 0.8 * r.activation_bytes


def test_xla_keeps_the_recomputation():
  """The recomputation reads its inputs through an optimization barrier, so XLA's CSE cannot
  merge it with the forward pass: the compiled step has more matmuls."""
  workload = corpus.load("gpt:mini,batch=16,layers=2")
  program = P.trace(workload.fn, *workload.args)
  dots = []
  for schedule in ("BatchParallel(batch)", "Remat(); BatchParallel(batch)"):
    pp = P.apply(program, "batch=8", schedule)
    text = pp.jit().lower(*workload.args).compile().as_text()
    dots.append(text.count(" dot("))
  assert dots[1] > dots[0] > 0


def test_the_cuts_are_kept_when_the_step_is_cut_into_micro_batches():
  workload = corpus.load("gpt:mini,batch=64,layers=6", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "batch=8", "Remat(); Microbatch(4); BatchParallel(batch)")
  whole = pp.program.original
  assert pp.program.microbatches == 4 and whole.recomputation is not None
  plain = P.apply(program, "batch=8", "Microbatch(4); BatchParallel(batch)")
  assert simulate(pp, "h100").peak_memory_bytes < 0.8 * simulate(plain, "h100").peak_memory_bytes


def _forward_only():
  def predict(params, x):
    return jnp.tanh(x @ params["w"])

  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return P.trace(predict, {"w": f32(8, 8)}, f32(4, 8))


def test_what_cannot_be_recomputed_is_refused_in_one_line():
  workload = corpus.load("gpt:mini,batch=16,layers=2", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  with pytest.raises(P.ScheduleError, match="Remat: .*already"):
    P.apply(P.apply(program, "batch=8", "Remat()").program, "batch=8", "Remat()")
  with pytest.raises(P.ScheduleError, match="Remat: put it before Microbatch"):
    P.apply(P.apply(program, "batch=8", "Microbatch(2)").program, "batch=8", "Remat()")
  with pytest.raises(P.ScheduleError, match="put it first"):
    P.apply(program, "batch=8", "BatchParallel(batch); Remat()")
  with pytest.raises(P.ScheduleError, match="before Microbatch, Pipeline and Remat"):
    P.apply(P.apply(program, "batch=8", "Remat()").program, "batch=8", "HeadPadding(batch)")
  with pytest.raises(P.ScheduleError, match="Pipeline.*recomputes its activations \\(Remat\\)"):
    P.apply(P.apply(program, "batch=8", "Remat()").program, "batch=8", "Pipeline(batch)")
  written = corpus.load("gpt:mini,batch=16,layers=2,remat=true", abstract=True)
  with pytest.raises(P.ScheduleError, match="written with jax.checkpoint"):
    P.apply(P.trace(written.fn, *written.args), "batch=8", "Remat()")
  scanned = corpus.load("gpt:mini,batch=16,layers=2,scan=true", abstract=True)
  with pytest.raises(P.ScheduleError, match="keeps a loop"):
    P.apply(P.trace(scanned.fn, *scanned.args, loops="keep"), "batch=8", "Remat()")
  with pytest.raises(P.ScheduleError, match="nothing to recompute: the step has no backward"):
    P.apply(_forward_only(), "batch=4", "Remat()")

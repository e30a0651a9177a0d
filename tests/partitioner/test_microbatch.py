"""`Microbatch(k)`: the step's batch cut into k micro-batches run in a loop, the loss and the
gradients summed across them, the update applied once. Exact against the whole-batch step,
under both lowerings and composed with other tactics; refused in one line where a step needs a
statistic of the whole batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import corpus
import partitioner as P
from partitioner.cost import simulate
from partitioner.verify import example_inputs, verify


def _run(program, args, seed=0):
  concrete = jax.tree_util.tree_unflatten(program.in_tree, example_inputs(args, seed))
  return jax.jit(program.evaluate)(*program.flatten_args(concrete))


def _cut_exactly(step, args, k: int):
  """The step traced and cut into `k` micro-batches, both run: the same outputs."""
  program = P.trace(step, *args)
  cut = P.apply(program, "batch=8", f"Microbatch({k})").program
  for a, b in zip(_run(program, args), _run(cut, args)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
  return program, cut


def _mlp_step(per_example=False, normalise_by_mask=False, dropout=False, batch_norm=False):
  def step(params, batch):
    def loss_fn(p):
      h = jnp.tanh(batch["x"] @ p["w1"])
      if batch_norm:
        h = h - jnp.mean(h, axis=0)
      if dropout:
        h = h * jax.random.bernoulli(batch["key"], 0.5, h.shape) / 0.5
      err = jnp.sum((h @ p["w2"] - batch["y"]) ** 2, axis=-1)
      if normalise_by_mask:
        return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"]), err
      return jnp.mean(err), err
    (loss, err), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return (new, loss, err) if per_example else (new, loss)

  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w1": f32(16, 32), "w2": f32(32, 8)}
  batch = {"x": f32(24, 16), "y": f32(24, 8)}
  if normalise_by_mask:
    batch["mask"] = f32(24)
  if dropout:
    batch["key"] = jax.ShapeDtypeStruct((2,), jnp.uint32)
  return step, (params, batch)


def test_the_loss_and_gradients_are_those_of_the_whole_batch():
  program, cut = _cut_exactly(*_mlp_step(), 4)
  assert cut.microbatches == 4 and cut.original is program and len(cut.regions) == 1
  assert cut.regions[0].length == 4


def test_outputs_per_example_come_back_in_their_order():
  step, args = _mlp_step(per_example=True)
  program = P.trace(step, *args)
  cut = P.apply(program, "batch=8", "Microbatch(3)").program
  expected, actual = _run(program, args), _run(cut, args)
  err = -1   # (new params, loss, per-example errors)
  assert actual[err].shape == (24,)
  np.testing.assert_allclose(np.asarray(actual[err]), np.asarray(expected[err]), rtol=1e-5)


def test_random_numbers_are_drawn_for_the_whole_batch_so_each_example_keeps_its_own():
  step, args = _mlp_step(dropout=True)
  program, _ = _cut_exactly(step, args, 2)
  result = verify(P.apply(program, "batch=8", "Microbatch(2); BatchParallel(batch)"), args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


SLOW = pytest.mark.slow   # on the pinned stack only: one case runs on both


@pytest.mark.parametrize("model, schedule", [
    ("hf_gpt2:small", "Microbatch(4); BatchParallel(batch); ZeRO(batch, stage=2)"),
    pytest.param("gpt:small", "Microbatch(2); BatchParallel(batch); Megatron(model)",
                 marks=SLOW),
    pytest.param("gpt:small,scan=true,layers=2,remat=true",
                 "Microbatch(4); BatchParallel(batch); BatchParallel(model); ZeRO(model, stage=3)",
                 marks=SLOW),
    pytest.param("hf_gpt2:small", "Microbatch(2); BatchParallel(batch); Megatron(model)",
                 marks=SLOW),
])
def test_microbatches_verify_under_both_lowerings_with_other_tactics(model, schedule):
  workload = corpus.load(model)
  pp = P.apply(P.trace(workload.fn, *workload.args), "batch=2,model=4", schedule)
  assert pp.program.microbatches == int(schedule[len("Microbatch("):schedule.index(")")])
  result = verify(pp, workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_activations_shrink_and_the_gradients_are_reduced_once_after_the_loop():
  workload = corpus.load("gpt:mini,batch=32", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  peaks, reduced = [], []
  for k in (1, 2, 4):
    schedule = ("" if k == 1 else f"Microbatch({k}); ") + "BatchParallel(batch)"
    pp = P.apply(program, "batch=8", schedule)
    peaks.append(simulate(pp, "h100").peak_memory_bytes)
    repeat = pp.program.op_repeat
    grads = [c for c in pp.collectives if c.kind == "all-reduce" and c.bytes > 1024]
    assert grads and all(repeat[c.op] == 1 for c in grads)   # once per step, not per micro-batch
    reduced.append(sum(c.bytes for c in grads))
  assert peaks[0] > peaks[1] > peaks[2]
  assert reduced[0] == reduced[1] == reduced[2]


def test_a_micro_batch_smaller_than_the_devices_it_is_split_over_is_named_and_priced():
  """A micro-batch of 2 examples over data=2,fsdp=2,tensor=2: fsdp and tensor find no example
  of their own, gather the micro-batch and repeat its work. `BatchParallel(fsdp)` says so,
  once, and the predicted computation grows with the repeated work."""
  workload = corpus.load("gpt:mini,batch=8", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  mesh, split = "data=2,fsdp=2,tensor=2", "BatchParallel(data); BatchParallel(fsdp); " \
      "BatchParallel(tensor)"
  compute, notes = [], []
  for k in (1, 2, 4):
    pp = P.apply(program, mesh, ("" if k == 1 else f"Microbatch({k}); ") + split)
    compute.append(simulate(pp, "h100").compute_s)
    notes.append([(r.tactic, n) for r in pp.reports for n in r.notes if "micro-batch of" in n])
  assert notes[0] == []
  assert notes[1] == [("BatchParallel(tensor)", notes[1][0][1])]
  assert "micro-batch of 4 examples does not split over data+fsdp+tensor (8 devices)" in \
      notes[1][0][1]
  assert [t for t, _ in notes[2]] == ["BatchParallel(fsdp)"]
  assert compute[0] < compute[1] < compute[2]


def test_a_loss_divided_by_a_count_over_the_batch_divides_by_the_whole_batch_count():
  _cut_exactly(*_mlp_step(normalise_by_mask=True), 2)


def test_a_statistic_of_the_whole_batch_that_depends_on_the_model_is_refused():
  step, args = _mlp_step(batch_norm=True)
  with pytest.raises(P.ScheduleError, match="a sum over the whole batch.*batch statistic"):
    P.apply(P.trace(step, *args), "batch=8", "Microbatch(2)")


def test_bad_micro_batch_counts_and_places_are_refused():
  step, args = _mlp_step()
  program = P.trace(step, *args)
  with pytest.raises(P.ScheduleError, match="a batch of 24 does not divide into 5"):
    P.apply(program, "batch=8", "Microbatch(5)")
  with pytest.raises(P.ScheduleError, match="put it first"):
    P.apply(program, "batch=8", "BatchParallel(batch); Microbatch(2)")
  with pytest.raises(P.ScheduleError, match="positive"):
    P.apply(program, "batch=8", "Microbatch(0)")
  twice = P.apply(program, "batch=8", "Microbatch(2)").program
  with pytest.raises(P.ScheduleError, match="already"):
    P.apply(twice, "batch=8", "Microbatch(2)")
  program.source = None   # not traced from a function: nothing to trace again
  with pytest.raises(P.ScheduleError, match="not traced from a function"):
    P.apply(program, "batch=8", "Microbatch(2)")


@pytest.mark.parametrize("loops", ["unroll", "keep"])
def test_a_step_that_accumulates_micro_batches_itself_is_cut_along_the_batch_not_its_loop(loops):
  """Micro-batches stacked for the user's own `lax.scan` (batch dimension 1): cut again, along
  that dimension, and still exact under data parallelism; kept as a loop, the user's scan sums
  its gradients into carries that start at zeros, inside the new loop."""
  from tests.partitioner import user_models
  fn, args = user_models.microbatched_mlp(accum=4, batch=16)
  pp = P.apply(P.trace(fn, *args, loops=loops), "batch=4", "Microbatch(2); BatchParallel(batch)")
  assert pp.program.microbatches == 2
  assert len(pp.program.regions) == (2 if loops == "keep" else 1)
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_a_scanned_stack_s_gradients_are_reduced_once_after_the_micro_batches():
  """The backward loop stacks each layer's gradient; summed into the micro-batch loop's carry,
  the stack stays partial and is all-reduced once, after it (not per micro-batch and layer)."""
  workload = corpus.load("gpt:small,scan=true,layers=6")
  program = P.trace(workload.fn, *workload.args)
  assert any(r.length == 6 for r in program.regions)
  pp = P.apply(program, "batch=4", "Microbatch(2); BatchParallel(batch)")
  repeat = pp.program.op_repeat
  grads = [c for c in pp.collectives if c.kind == "all-reduce" and c.bytes > 1024]
  assert grads and all(repeat[c.op] == 1 for c in grads)
  whole = P.apply(program, "batch=4", "BatchParallel(batch)")
  per_layer = [c for c in whole.collectives if whole.program.op_repeat[c.op] == 6]
  assert per_layer   # without micro-batches, each layer's gradient is reduced as it is made
  result = verify(pp, workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


@pytest.mark.slow   # on the pinned stack only (CI time)
def test_flax_scanned_blocks_in_a_train_state_cut_and_verify_with_megatron():
  """Written by others: Flax `nn.scan` blocks, a `TrainState`, AdamW."""
  from tests.partitioner import user_models
  fn, args = user_models.flax_scanned_blocks()
  pp = P.apply(P.trace(fn, *args), "batch=4,model=2",
               "Microbatch(2); BatchParallel(batch); Megatron(model)")
  assert pp.program.microbatches == 2
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_a_rewrite_is_made_once_for_the_plans_that_share_it(monkeypatch):
  """`partition.rewrite_kept`: the same cut of the same step under two plans is traced once;
  the two plans share the cut program and each keeps its own shardings."""
  from partitioner import partition
  step, args = _mlp_step()
  program = P.trace(step, *args)
  traced = []
  rewrite = P.Microbatch.rewrite
  monkeypatch.setattr(P.Microbatch, "rewrite",
                      lambda self, *a: traced.append(self) or rewrite(self, *a))
  a = P.apply(program, "batch=8", "Microbatch(2); BatchParallel(batch)")
  b = P.apply(program, "batch=8", "Microbatch(2)")
  assert len(traced) == 1 and a.program is b.program
  assert a.sharding(a.program.input_names[-1]) != b.sharding(b.program.input_names[-1])
  P.apply(program, "batch=8", "Microbatch(3)")
  assert len(traced) == 2
  assert len(partition._rewrites) <= partition.REWRITES_KEPT

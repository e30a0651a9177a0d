"""`Pipeline(axis, stages, microbatches, schedule)`: a scanned layer stack cut into stages that
micro-batches stream through, in SPMD form, in GPipe's order, 1F1B's or interleaved 1F1B's
(virtual stages). Exact against the
whole step, unpartitioned and under both lowerings, composed with data parallelism, Megatron
and ZeRO; the hand-over between stages is one collective permute each way per iteration, as XLA
compiles it; refused in one line where the step cannot be cut so."""

import jax
import numpy as np
import pytest

import corpus
from corpus.experts import simulate_experts
import partitioner as P
from partitioner.cost import simulate
from partitioner.errors import MeshError, ScheduleError
from partitioner.hlo import hlo_collectives
from partitioner.verify import example_inputs, verify
from tests.partitioner import user_models


@pytest.fixture(scope="module")
def gpt():
  """The corpus GPT with `hk.layer_stack`: 4 layers, a loop and its gradient loop."""
  w = corpus.load("gpt:small,layers=4,scan=true")
  return w.fn, w.args, P.trace(w.fn, *w.args, loops="keep")


def _run(program, args):
  concrete = jax.tree_util.tree_unflatten(program.in_tree, example_inputs(args, 0))
  return jax.jit(program.evaluate)(*program.flatten_args(concrete))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipelined_step_is_the_step(gpt, schedule):
  fn, args, program = gpt
  pp = P.apply(program, "stage=2",
               f"Pipeline(stage, stages=2, microbatches=4, schedule={schedule})")
  cut = pp.program
  assert (cut.stages, cut.microbatches, cut.original) == (2, 4, program)
  top = [r for r in cut.regions if r.parent < 0]
  inner = [r for r in cut.regions if r.parent >= 0]
  if schedule == "gpipe":   # the stack's forward loop, then its backward, M + S - 1 each
    assert [(r.length, r.reverse) for r in top] == [(5, False), (5, True)]
  else:   # the layers of a stage once on zeros (what the ring starts as), S - 1 iterations
    # of forward work, then M + S - 1 of forward and backward work
    assert [(r.length, r.reverse) for r in top] == [(2, False), (1, False), (5, False)]
    ring = [cut.values[v].shape for v, _ in cut.stage_values if cut.values[v].rank == 6]
    assert ring and all(shape[:3] == (2, 2, 3) for shape in ring)   # S, L/S, 2S - 1 slots
  assert {r.length for r in inner} == {2}                            # L / S layers
  # Sums over micro-batches round differently; Adam's first step turns that into up to 3e-5
  # on moments of gradients near zero (the float64 oracle of `verify` judges that exactly).
  for a, b in zip(_run(program, args), _run(cut, args)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-4)
  # Every stacked weight (and its optimizer state) lives on its stage only.
  stacked = [n for n in cut.input_names if "layer_stack" in n and not n.endswith("count")]
  assert stacked and all(pp.sharding(n).dims[0] == ("stage",) for n in stacked)


SCHEDULES = {
    "gpipe dp": ("stage=2,batch=4",
                 "Pipeline(stage, microbatches=2, schedule=gpipe); BatchParallel(batch)"),
    "gpipe megatron": ("stage=2,batch=2,model=2",
                       "Pipeline(stage, microbatches=2, schedule=gpipe); BatchParallel(batch); "
                       "Megatron(model)"),
    "gpipe two stages a device": ("stage=2,batch=4",
                                  "Pipeline(stage, stages=4, microbatches=2, schedule=gpipe); "
                                  "ZeRO(batch, stage=1)"),
    "1f1b dp": ("stage=2,batch=4", "Pipeline(stage, microbatches=4); BatchParallel(batch)"),
    "1f1b megatron": ("stage=2,batch=2,model=2",
                      "Pipeline(stage, microbatches=2); BatchParallel(batch); Megatron(model)"),
    "1f1b zero3": ("stage=4,batch=2", "Pipeline(stage, microbatches=2); ZeRO(batch, stage=3)"),
}


# 1F1B with Megatron also runs on current JAX (GPipe does in test_the_pipelined_step_is_the_step).
BOTH_STACKS = ("1f1b megatron",)


@pytest.mark.parametrize("name", [n if n in BOTH_STACKS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SCHEDULES])
def test_pipeline_verifies_composed_with_other_tactics(gpt, name):
  fn, args, program = gpt
  mesh, schedule = SCHEDULES[name]
  pp = P.apply(program, mesh, schedule)
  assert not pp.fallbacks
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"
  if "megatron" in name:
    assert any(c.axes == ("model",) for c in pp.collectives)
  if name.startswith("1f1b"):
    # The gradients are summed over micro-batches partial, and reduced once after the loops.
    loops = {i for r in pp.program.regions for i in range(r.enter + 1, r.exit)}
    assert not [c for c in pp.collectives if c.op in loops and "batch" in c.axes and
                pp.program.values[c.value].rank >= 2 and c.kind == "all-reduce"]


@pytest.mark.slow
def test_flax_nn_scan_train_state_pipelines():
  """Written by the Flax book: `nn.scan` over blocks, `TrainState.apply_gradients`, AdamW."""
  fn, args = user_models.flax_scanned_blocks(layers=4)
  program = P.trace(fn, *args, loops="keep")
  pp = P.apply(program, "stage=4,batch=2", "Pipeline(stage, microbatches=2); BatchParallel(batch)")
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


HF_SCHEDULES = {
    "1f1b megatron": ("stage=2,batch=2,model=2",
                      "Pipeline(stage, microbatches=2); BatchParallel(batch); Megatron(model)"),
    "1f1b zero3": ("stage=4,batch=2", "Pipeline(stage, microbatches=2); ZeRO(batch, stage=3)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family, name", [("hf_gpt2", n) for n in HF_SCHEDULES]
                         + [("hf_llama", "1f1b megatron")])
def test_an_hf_model_pipelines_with_its_blocks_under_nn_scan(family, name):
  """HF's own blocks under nn.scan (`stack=scan`), AdamW: GPT-2's FlaxGPT2Block (fused q/k/v,
  Conv1D kernels used transposed) pipelined with Megatron or ZeRO-3 on the other axis, and
  Llama's decoder layer (grouped key/value heads, SwiGLU) with Megatron; each verifies under
  both lowerings. Megatron finds the same weight pairs in the pipelined step as in the step
  traced: the forward pass of a loop that runs forward and backward work is what the loss
  depends on carry by carry (`roles.ancestors(..., by_carry=True)`), and the kept activations
  are accounted as such."""
  w = corpus.load(f"{family}:small,layers=4,stack=scan,batch=16")
  program = P.trace(w.fn, *w.args, loops="keep")
  mesh, schedule = HF_SCHEDULES[name]
  pp = P.apply(program, mesh, schedule)
  assert not pp.fallbacks and pp.program.stages > 1
  result = verify(pp, w.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"
  stack, parts = {
      "hf_gpt2": ("transformer/h", ("mlp/c_fc", "mlp/c_proj", "attn/c_proj")),
      "hf_llama": ("model/layers", ("mlp/gate_proj", "mlp/down_proj", "self_attn/k_proj",
                                    "self_attn/o_proj"))}[family]
  kernel = lambda n: f"params/{stack}/layers/block/{n}/kernel"
  if "megatron" in name:
    traced = P.apply(program, "batch=2,model=2", "BatchParallel(batch); Megatron(model)")
    for part in parts:
      assert pp.sharding(kernel(part)).dims[1:] == traced.sharding(kernel(part)).dims[1:]
      assert "model" in str(pp.sharding(kernel(part)).dims)
    assert pp.sharding(kernel(parts[0])).dims[0] == ("stage",)
  assert simulate(pp, "h100").memory.breakdown["activations"] > 0


def test_a_python_loop_over_layers_is_refused_with_the_remedy():
  w = corpus.load("hf_gpt2:small")
  with pytest.raises(ScheduleError, match="Python loop over layers.*nn.scan"):
    P.apply(P.trace(w.fn, *w.args), "stage=2", "Pipeline(stage, stages=2, microbatches=2)")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_weights_cast_once_before_the_stack_pipeline(schedule):
  """A step that casts its float32 master weights to bf16 once, before the stack (as MaxText
  and Megatron-LM run): the transposed cast of the layers' gradients runs once, after the
  loops, on their sums (it failed to trace under 1F1B before), and the bf16 gradients, summed
  in float32 over the micro-batches, are reduced over the data axis once, after the loops
  (they were all-reduced in every iteration: 6x the bytes at Megatron-LM's 39.1B)."""
  import jax.numpy as jnp
  fn, args = user_models.scanned_decoder(dtype=jnp.bfloat16)
  program = P.trace(fn, *args, loops="keep")
  pp = P.apply(program, "stage=2,batch=4",
               f"Pipeline(stage, microbatches=2, schedule={schedule}); BatchParallel(batch)")
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"
  loops = {i for r in pp.program.regions for i in range(r.enter + 1, r.exit)}
  reduced = [c for c in pp.collectives if "batch" in c.axes and c.kind == "all-reduce"
             and pp.program.values[c.value].rank >= 2]
  assert reduced and not [c for c in reduced if c.op in loops]


def test_the_hand_over_is_one_collective_permute_each_way_as_xla_compiles_it(gpt):
  fn, args, program = gpt
  pp = P.apply(program, "stage=2,batch=4",
               "Pipeline(stage, microbatches=2, schedule=gpipe); BatchParallel(batch)")
  permutes = [c for c in pp.collectives if c.kind == "collective-permute"]
  # One slot of the state crosses: a micro-batch of 8 / 2 sequences split over 4 devices,
  # 16 x 64 float32 activations each, forward and backward.
  row = (8 // 2 // 4) * 16 * 64 * 4
  assert [(c.axes, c.bytes) for c in permutes] == [(("stage",), row)] * 2
  text = pp.jit().lower(*args).compile().as_text()
  compiled = [c for c in hlo_collectives(text, pp.mesh) if c.kind == "collective-permute"]
  assert sorted(c.bytes for c in compiled) == [row, row]


@pytest.mark.slow   # on the pinned stack only: the lowering is the pipelines' own
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_scatter_splits_the_hand_over_and_what_a_stage_keeps(gpt, schedule):
  """Megatron-LM's scatter/gather: the activations crossing stages are split over the tensor
  axis, so each permute moves half the bytes over `model=2`, the stages keep less, the layers
  are sharded as Megatron alone shards them (the gather is where a stage reads a hand-over,
  not a split residual stream through the layers), and the step is still exact."""
  fn, args, program = gpt
  base = (f"Pipeline(stage, microbatches=2, schedule={schedule}); BatchParallel(batch); "
          "Megatron(model)")
  plain, split = (P.apply(program, "stage=2,batch=2,model=2", s)
                  for s in (base, base + "; StageScatter(model)"))
  moved = lambda pp: sorted(c.bytes for c in pp.collectives if c.kind == "collective-permute")
  assert moved(split) == [b // 2 for b in moved(plain)]
  assert simulate(split, "h100").peak_memory_bytes < simulate(plain, "h100").peak_memory_bytes
  assert any(c.kind == "all-gather" and c.axes == ("model",) for c in split.collectives)
  layers = lambda pp: sorted((c.kind, c.bytes) for c in pp.collectives
                             if c.axes == ("model",) and c.kind != "all-gather")
  assert layers(split) == layers(plain)
  result = verify(split, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_stage_scatter_needs_a_pipeline_and_features_that_divide(gpt):
  fn, args, program = gpt
  with pytest.raises(ScheduleError, match="not pipelined"):
    P.apply(program, "batch=2,model=4", "BatchParallel(batch); StageScatter(model)")
  with pytest.raises(ScheduleError, match="divide over model=3"):
    P.apply(program, "stage=2,model=3", "Pipeline(stage, microbatches=2); StageScatter(model)")


def test_more_micro_batches_shrink_the_bubble(gpt):
  fn, args, program = gpt
  flops = {m: simulate(P.apply(program, "stage=4",
                               f"Pipeline(stage, microbatches={m}, schedule=gpipe)"),
                        "h100").flops
           for m in (2, 4)}
  # The stack runs M+S-1 iterations for M micro-batches: 5/2 of its work at M=2, 7/4 at M=4;
  # the rest of the step is the same.
  assert 1.1 < flops[2] / flops[4] < 5 / 2 / (7 / 4)


@pytest.mark.parametrize("schedule, message", [
    ("Pipeline(stage, stages=3, microbatches=2)", "4 layers, which do not divide into 3 stages"),
    ("Pipeline(stage, stages=2, microbatches=3)", "does not divide into 3 micro-batches"),
    ("Pipeline(stage, stages=2, microbatches=2, schedule=interleaved, virtual=4)",
     "4 layers, which do not divide into 2 stages of 4 virtual stages"),
    ("Pipeline(stage, stages=2, microbatches=1, schedule=interleaved)",
     "1 micro-batches do not divide into rounds of 2"),
    ("Pipeline(stage, stages=2, microbatches=2, virtual=2)",
     "the interleaved schedule takes 2 or more, the others 1"),
    ("Pipeline(stage, stages=3, microbatches=2, schedule=zigzag)", "schedule must be one of"),
    ("Pipeline(stage, microbatches=2); Microbatch(2)", "cut into micro-batches already"),
])
def test_what_cannot_be_pipelined_is_refused_in_one_line(gpt, schedule, message):
  fn, args, program = gpt
  with pytest.raises(ScheduleError, match=message):
    P.apply(program, "stage=2", schedule)


def test_a_stage_count_that_does_not_divide_the_axis_or_an_unknown_axis_is_refused(gpt):
  fn, args, program = gpt
  with pytest.raises(ScheduleError, match="2 stages do not divide over stage=4"):
    P.apply(program, "stage=4", "Pipeline(stage, stages=2, microbatches=2)")
  with pytest.raises(MeshError, match="unknown mesh axis 'pipe'"):
    P.apply(program, "stage=4", "Pipeline(pipe)")


def test_a_step_without_a_layer_stack_is_refused():
  fn, args = user_models.grouped_query_attention()
  with pytest.raises(ScheduleError, match="found no layer stack"):
    P.apply(P.trace(fn, *args), "stage=2", "Pipeline(stage, stages=2, microbatches=2)")


def test_ptd_p_and_pp_dp_are_hand_schedules_that_apply_to_a_scanned_stack():
  """Megatron-LM's PTD-P among the hand schedules `propose` and `evaluate` try: pipeline over
  the outermost axis, data parallel over the middle ones, Megatron over the model axis."""
  schedules = corpus.experts(None, ("pipe", "data", "model"))
  assert schedules["ptd-p"] == "Pipeline(pipe); BatchParallel(data); Megatron(model)"
  assert schedules["pp+dp"] == "Pipeline(pipe); BatchParallel(data); BatchParallel(model)"
  w = corpus.load("gpt:small,layers=4,scan=true,batch=32")
  program = P.trace(w.fn, *w.args, loops="keep")
  results = {r.name: r for r in simulate_experts(program, "pipe=2,data=2,model=2",
                                                 "h100", None)}
  assert results["ptd-p"].cost is not None and results["pp+dp"].cost is not None
  # A stage holds half the layers: their parameters and optimizer state per device halve.
  dp, pp = results["dp"].cost.memory.breakdown, results["pp+dp"].cost.memory.breakdown
  stacked = lambda b: b["parameters"] + b["optimizer_state"]
  assert stacked(pp) < stacked(dp)


@pytest.mark.parametrize("S, M, V", [(2, 4, 1), (2, 8, 3), (4, 8, 2), (3, 6, 4)])
def test_the_interleaved_timetable_runs_every_chunk_once_in_order(S, M, V):
  """Micro-batch m runs forward through virtual stages 0 .. VS-1 one iteration apart (stage j
  on device j mod S), its loss in the iteration the last one runs, and backward through them
  in reverse one iteration apart; a stage runs one chunk at a time, and reads back the slot
  of its ring that its forward wrote, before the ring comes round to it again."""
  from partitioner.pipeline import _timetable
  table, VS = _timetable(S, M, V), V * S
  T, D = len(table["write"]), 2 * VS - 1
  fwd, bwd = {}, {}
  for t in range(T):
    for s in range(S):
      u = t - s
      if 0 <= u < V * M:
        m, j = u // VS * S + u % S, (u % VS) // S * S + s
        assert table["forward"][t, s] == j // S
        fwd[m, j] = t
      u = t - (VS - 1) - (S - 1 - s)
      if 0 <= u < V * M:
        m, j = u // VS * S + u % S, (V - 1 - (u % VS) // S) * S + s
        assert table["backward"][t, s] == j // S
        assert table["read"][t, s] == table["write"][fwd[m, j]]   # its own activations
        assert t - fwd[m, j] < D                                   # not written over since
        bwd[m, j] = t
  everything = {(m, j) for m in range(M) for j in range(VS)}
  assert set(fwd) == set(bwd) == everything
  for m in range(M):
    assert all(fwd[m, j + 1] == fwd[m, j] + 1 for j in range(VS - 1))
    assert all(bwd[m, j - 1] == bwd[m, j] + 1 for j in range(1, VS))
    assert bwd[m, VS - 1] == fwd[m, VS - 1]                        # the loss, then back
    t = fwd[m, 0]
    assert table["enter"][t] and table["in_valid"][t] and table["m_in"][t] == m
    t = fwd[m, VS - 1]
    assert table["out_valid"][t] and table["m_out"][t] == m
    t = bwd[m, 0]
    assert table["ret_valid"][t] and table["m_ret"][t] == m and table["leave"][t]
  assert table["in_valid"].sum() == table["out_valid"].sum() == table["ret_valid"].sum() == M


@pytest.fixture(scope="module")
def gpt6():
  """The corpus GPT with 6 scanned layers and a batch of 16: 2 stages of 3 chunks each."""
  w = corpus.load("gpt:small,layers=6,scan=true,batch=16")
  return w.fn, w.args, P.trace(w.fn, *w.args, loops="keep")


INTERLEAVED = "Pipeline(stage, microbatches=8, schedule=interleaved, virtual=3)"


@pytest.mark.slow   # on the pinned stack only: the lowering is the pipelines' own
def test_interleaved_stages_verify_composed_with_other_tactics(gpt6):
  """Stage s holds chunks s, s+2, s+4 of the 6 layers: the stacked weights, their optimizer
  state and gradients are held with each stage's chunks together, and split over `stage`
  each stage has its own; each stage's chunk gradients are scatter-added into its rows, held
  partial over the data axis through the loops of loops and reduced once after them. With
  data parallelism, Megatron, ZeRO-3 over the data axis and the scatter/gather at once."""
  fn, args, program = gpt6
  pp = P.apply(program, "stage=2,batch=2,model=2", f"{INTERLEAVED}; BatchParallel(batch); "
               "Megatron(model); ZeRO(batch, stage=3); StageScatter(model)")
  cut = pp.program
  assert not pp.fallbacks
  assert [r.length for r in cut.regions if r.parent < 0 and r.num_carry > 4][:3] == [2, 2, 1]
  assert any(r.parent >= 0 and r.length in (2, 4) for r in cut.regions)   # rounds of loops
  held = {cut.input_names[k]: str(lay) for k, lay in cut.layouts.items()}
  stacked = [n for n in cut.input_names if "layer_stack" in n and not n.endswith("count")]
  assert stacked and all("held by stage" in held[n] for n in stacked)
  assert all(pp.sharding(n).dims[0] == ("stage",) for n in stacked)
  assert not [c for c in pp.collectives if "stage" in c.axes and c.kind == "all-gather"]
  loops = {i for r in cut.regions for i in range(r.enter + 1, r.exit)}
  assert not [c for c in pp.collectives if c.op in loops and "batch" in c.axes and
              cut.values[c.value].rank >= 2 and c.kind == "all-reduce"]
  result = verify(pp, args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"

"""The real-models tier: HuggingFace Flax models, written by others, partition and verify under
data, tensor and fully sharded data parallelism, at published sizes they trace and simulate
from abstract arguments, and their three spellings and bf16 variants behave."""

import collections

import jax
import numpy as np
import pytest

import corpus
import partitioner as P
from corpus.workload import parameter_count
from partitioner.cost import CATALOG, simulate
from partitioner.verify import verify

pytestmark = pytest.mark.slow   # HuggingFace models compiled under several strategies

MESH = "batch=2,model=4"
REAL = ("hf_gpt2", "hf_bert", "hf_t5", "hf_vit")


@pytest.mark.parametrize("strategy", ["dp", "zero3", "megatron", "dp+megatron"])
@pytest.mark.parametrize("family", REAL)
def test_real_models_verify_under_data_tensor_and_fully_sharded_parallelism(family, strategy,
                                                                            traced):
  workload, program = traced(f"{family}:small")
  pp = P.apply(program, MESH, corpus.experts(family)[strategy])
  assert pp.fallbacks == {}
  if strategy == "dp":   # pure data parallelism sums gradients, statistics and the loss only
    assert {c.kind for c in pp.collectives} == {"all-reduce"}
  result = verify(pp, workload.args)
  assert result.ok, f"{family} {strategy}: max error {result.max_abs_err} in {result.worst}"


def test_gpt2_fused_attention_is_split_by_heads(traced):
  _, program = traced("hf_gpt2:small")
  pp = P.apply(program, MESH, "BatchParallel(batch); Megatron(model)")
  # Every attention-score matmul (batch dims: batch and heads) holds a quarter of the heads.
  scores = [op for op in program.ops if op.name == "dot_general"
            and len(op.params["dimension_numbers"][1][0]) == 2]
  assert scores
  for op in scores:
    out = op.outputs[0]
    assert any("model" in d for d in pp.state.dims[out]), program.name(out)
  # The fused kernel is held interleaved (partitioner/layouts.py), so its rows split by heads.
  layouts = pp.summary()["layouts"]
  assert layouts["params/transformer/h/0/attn/c_attn/kernel"] == \
      "dimension 0 interleaved by its 3 chunks"
  shardings = pp.summary()["shardings"]
  assert shardings["params/transformer/h/0/attn/c_attn/kernel"] == ["model"]
  assert shardings["params/transformer/h/0/attn/c_proj/kernel"] == [None, "model"]
  kinds = collections.Counter(c.kind for c in pp.collectives if c.axes == ("model",))
  # Per layer: the attention and MLP blocks' outputs are summed forward, their inputs'
  # gradients backward; nothing is gathered.
  assert kinds == {"all-reduce": 8}


@pytest.mark.parametrize("spec,low,high", [
    ("hf_gpt2:124m", 123e6, 126e6), ("hf_bert:large", 330e6, 340e6),
    ("hf_t5:220m", 220e6, 226e6), ("hf_vit:base", 85e6, 88e6),
])
def test_published_sizes_trace_and_simulate_from_abstract_arguments(spec, low, high):
  workload = corpus.load(spec)
  assert workload.abstract
  assert low < parameter_count(workload.args[0]) < high
  program = P.trace(workload.fn, *workload.args)
  family = spec.split(":")[0]
  reports = {name: simulate(P.apply(program, "batch=8,model=4", corpus.experts(family)[name]),
                            "h100") for name in ("dp", "zero3", "dp+megatron")}
  assert reports["zero3"].memory.peak_bytes < reports["dp"].memory.peak_bytes
  assert reports["dp+megatron"].memory.breakdown["parameters"] < \
      reports["dp"].memory.breakdown["parameters"]


def test_bf16_verifies_and_costs_half_the_bytes_and_less_time(traced):
  workload, program = traced("hf_gpt2:small,dtype=bfloat16")
  _, f32 = traced("hf_gpt2:small")
  assert {program.values[v].dtype for v in program.inputs[:4]} == {np.dtype(jax.numpy.bfloat16)}
  schedule = "BatchParallel(batch); Megatron(model)"
  pp = P.apply(program, MESH, schedule)
  result = verify(pp, workload.args)
  assert result.ok and result.rtol == 1e-4, result   # scaled per output inside: bf16 eps
  bf16_cost, f32_cost = simulate(pp, "h100"), simulate(P.apply(f32, MESH, schedule), "h100")
  assert bf16_cost.memory.breakdown["parameters"] * 2 == pytest.approx(
      f32_cost.memory.breakdown["parameters"], rel=0.01)
  assert bf16_cost.hbm_bytes < 0.75 * f32_cost.hbm_bytes
  # Less kernel time; at this toy size the launches (4 us each) are most of the step, and the
  # bf16 program's are about as many, so the step is compared on the kernels' roofline.
  roofline = CATALOG["h100"].launching(0.0)
  assert (simulate(pp, roofline).compute_s <
          simulate(P.apply(f32, MESH, schedule), roofline).compute_s)


def test_train_state_spelling_costs_the_same_as_named_arguments(traced):
  workload, program = traced("hf_vit:small,style=train_state")
  _, named = traced("hf_vit:small")
  assert program.input_names[0].startswith("state/params/")
  assert not any(n == "state/step" for n in program.input_names)  # a Python int: a constant
  schedule = "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1)"
  pp = P.apply(program, MESH, schedule)
  assert verify(pp, workload.args).ok
  a, b = simulate(pp, "h100"), simulate(P.apply(named, MESH, schedule), "h100")
  assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-6)
  assert a.memory.breakdown["optimizer_state"] == b.memory.breakdown["optimizer_state"]


def test_bf16_compute_with_f32_master_weights(traced):
  workload, program = traced("hf_gpt2:small,dtype=bfloat16,param_dtype=float32")
  _, f32 = traced("hf_gpt2:small")
  assert {program.values[v].dtype for v in program.inputs[:4]} == {np.dtype(np.float32)}
  schedule = "BatchParallel(batch); Megatron(model)"
  pp = P.apply(program, MESH, schedule)
  assert verify(pp, workload.args).ok   # f32 outputs of a bf16 computation: bf16's tolerance
  mixed, full = simulate(pp, "h100"), simulate(P.apply(f32, MESH, schedule), "h100")
  assert mixed.memory.breakdown["parameters"] == full.memory.breakdown["parameters"]
  assert mixed.compute_s < full.compute_s


def test_gpt2_dp_megatron_collectives_match_xla(traced):
  """XLA, given the plan's shardings (and the jit lowering's islands and slice constraints),
  compiles the same collectives per kind as the plan, bytes within 10%. (docs/real_models.md shows
  GPT-2 124M on batch=4,model=4: equal counts and bytes.)"""
  from partitioner.hlo import compare, hlo_collectives
  workload, program = traced("hf_gpt2:small")
  pp = P.apply(program, MESH, corpus.experts("hf_gpt2")["dp+megatron"])
  compiled = pp.jit(pp.mesh.to_jax()).lower(*workload.args).compile()
  rows = compare(pp.collectives, hlo_collectives(compiled.as_text(), pp.mesh))
  assert {r.kind for r in rows} == {"all-reduce"}   # the fused kernel split: nothing gathered
  for r in rows:
    assert r.ratio == pytest.approx(1.0, abs=0.1), rows

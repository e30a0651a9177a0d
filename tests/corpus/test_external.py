"""The external tier: HuggingFace Flax models no policy trains on, at published shapes. Each
traces with a rule for every op and takes the generic hand schedules; the idioms the corpus
lacks (grouped- and multi-query attention, a fused query_key_value, ALiBi, sliding windows)
partition and run correctly."""

import jax
import pytest

import corpus
import partitioner as P
from corpus.experts import GENERIC
from corpus.workload import parameter_count
from partitioner.verify import verify

pytestmark = pytest.mark.slow   # HuggingFace models traced and compiled

EXTERNAL = corpus.split("external")


@pytest.mark.parametrize("family", EXTERNAL)
def test_every_generic_hand_schedule_applies_with_a_rule_for_every_op(family, traced):
  _, program = traced(f"{family}:small")
  schedules = corpus.experts(family, ("batch", "model"))
  assert set(schedules) == set(GENERIC)
  for name in ("dp", "zero3", "dp+megatron"):
    pp = P.apply(program, "batch=2,model=4", schedules[name])
    assert pp.fallbacks == {}, (family, name, set(pp.fallbacks.values()))


@pytest.mark.parametrize("family,strategy", [("hf_llama", "dp+megatron"),
                                             ("hf_bloom", "dp+megatron")])
def test_the_idioms_the_corpus_lacks_run_correctly(family, strategy, traced):
  workload, program = traced(f"{family}:small")
  pp = P.apply(program, "batch=2,model=4", corpus.experts(family)[strategy])
  result = verify(pp, workload.args)
  assert result.ok, f"{family} {strategy}: max error {result.max_abs_err} in {result.worst}"
  if family == "hf_llama":   # its untied output head split by the vocabulary, exactly
    assert pp.sharding("params/lm_head/kernel").dims == ((), ("model",))


@pytest.mark.parametrize("spec,low,high", [
    ("hf_llama:7b", 6.7e9, 6.8e9), ("hf_mistral:7b", 7.2e9, 7.3e9),
    ("hf_bloom:560m", 558e6, 561e6), ("hf_gemma:2b", 2.5e9, 2.52e9),
])
def test_published_shapes_have_published_parameter_counts(spec, low, high):
  family, config = corpus.parse(spec)
  shapes = jax.eval_shape(family.make(config)[1], jax.random.PRNGKey(0))
  assert low < parameter_count(shapes[0]) < high

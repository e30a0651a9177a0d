"""Corpus names, presets, knobs and abstract arguments."""

import jax
import pytest

import corpus
import partitioner as P
from corpus.workload import parameter_count
from partitioner.errors import WorkloadError


def test_presets_and_knobs():
  family, config = corpus.parse("gpt:small,layers=4,d_model=128")
  assert family.name == "gpt" and config.layers == 4 and config.d_model == 128
  _, config = corpus.parse("gpt:layers=24,d_model=2048")
  assert config.layers == 24 and config.heads == 8


@pytest.mark.parametrize("spec,message", [
    ("llama:small", "'llama' is neither a corpus family"),
    ("gpt:layers=two", "knob layers wants int"),
    ("mlp:tiny", "mlp has no preset 'tiny'"),
    ("nothing", "unknown model 'nothing'"),
])
def test_bad_specs(spec, message):
  with pytest.raises(WorkloadError, match=message):
    corpus.load(spec)


@pytest.mark.slow
def test_large_models_are_abstract_and_trace_without_memory():
  workload = corpus.load("gpt:1.3b")
  assert workload.abstract
  assert 1.2e9 < parameter_count(workload.args[0]) < 1.5e9
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "batch=8,model=8", "BatchParallel(batch); Megatron(model)")
  assert pp.sharding("params/gpt/layer_0/w_in/w").dims == ((), ("model",))


def test_small_models_are_concrete():
  workload = corpus.load("mlp:small")
  assert not workload.abstract
  assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(workload.args))

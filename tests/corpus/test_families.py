"""Every corpus family traces, partitions under batch parallelism and runs correctly."""

import collections

import pytest

import corpus
import partitioner as P
from partitioner.verify import verify


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in corpus.FAMILIES   # the real-models tier: in
                                    if f not in corpus.split("external")   # test_real_models
                                    and f not in corpus.split("real")])
def test_batch_parallel_verifies_with_gradient_all_reduces_only(family):
  workload = corpus.load(f"{family}:small")
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  assert pp.fallbacks == {}, f"{family}: ops without a rule: {set(pp.fallbacks.values())}"
  kinds = collections.Counter(c.kind for c in pp.collectives)
  # Pure data parallelism communicates only to sum gradients, statistics and the loss.
  assert set(kinds) == {"all-reduce"}, f"{family}: {kinds}"
  for name in program.input_names:
    if name.startswith("batch/"):
      assert pp.sharding(name).dims[0] == ("batch",), name
  result = verify(pp, workload.args)
  assert result.ok, f"{family}: max error {result.max_abs_err} in {result.worst}"


def test_splits_partition_the_families():
  splits = [set(corpus.split(s)) for s in ("train", "heldout", "real", "external")]
  train, heldout, real, external = splits
  assert len(train) >= 5 and len(heldout) >= 3 and len(external) >= 8
  assert real == {"hf_gpt2", "hf_bert", "hf_t5", "hf_vit"}
  assert sum(map(len, splits)) == len(set.union(*splits)) == len(corpus.FAMILIES)
  with pytest.raises(P.WorkloadError, match="unknown split 'test'"):
    corpus.split("test")


@pytest.mark.parametrize("spec,params", [
    ("gpt:6.7b", (6.4e9, 7.0e9)), ("bert:large", (3.2e8, 3.6e8)), ("vit:base", (8.4e7, 8.8e7)),
    ("resnet:50", (2.4e7, 2.7e7)), ("t5:large", (6.5e8, 8.0e8)),
])
def test_realistic_sizes_have_published_parameter_counts(spec, params):
  import jax
  from corpus.workload import parameter_count
  family, config = corpus.parse(spec)
  shapes = jax.eval_shape(family.make(config)[1], jax.random.PRNGKey(0))
  assert params[0] < parameter_count(shapes[0]) < params[1]


@pytest.mark.parametrize("spec,message", [
    ("resnet:depth=20", "depth must be one of"),
    ("vit:image=30", "not a multiple of patch"),
    ("unet:image=12,levels=4", "does not halve"),
])
def test_bad_knobs_are_named(spec, message):
  with pytest.raises(P.WorkloadError, match=message):
    corpus.load(spec)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "bert", "vit", "t5", "moe"])
def test_remat_trades_activation_memory_for_recompute(family):
  from partitioner.cost import simulate
  reports = {}
  for remat in ("false", "true"):
    workload = corpus.load(f"{family}:small,batch=32,remat={remat}")
    pp = P.apply(P.trace(workload.fn, *workload.args), "batch=8", "BatchParallel(batch)")
    reports[remat] = simulate(pp, "h100")
  kept, recomputed = reports["false"], reports["true"]
  assert recomputed.memory.breakdown["activations"] < kept.memory.breakdown["activations"] / 10
  assert recomputed.memory.peak_bytes < kept.memory.peak_bytes
  assert recomputed.flops > 1.1 * kept.flops

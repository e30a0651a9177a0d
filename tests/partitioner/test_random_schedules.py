"""Random legal schedules never produce a wrong program (benchmarks/fuzz_partitioner.py).

`make test` runs a bounded number of cases across the corpus' families and 1-D and 2-D meshes;
`make fuzz N=...` runs many more and writes a report. A failure shrinks to a minimal schedule
(hypothesis), to be pinned below as a regression test."""

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz_partitioner as fuzz  # noqa: E402

pytestmark = pytest.mark.slow   # many random programs, each compiled twice

# Small programs of every kind of op: dense, attention, convolutions with batch norm and
# pooling, gathers and scatters, routed experts, a kept loop, a HuggingFace model.
FAMILIES = ("mlp", "gpt", "resnet", "gnn", "moe", "ssm", "hf_gpt2")


@seed(20261125)
@settings(max_examples=5, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(fuzz.cases(families=FAMILIES))
def test_random_schedules_partition_correctly(case):
  family, mesh, schedule, source = case
  result = fuzz.check(family, mesh, schedule)
  assert result["outcome"] in ("ok", "refused"), (family, mesh, schedule, source, result)


def test_refused_schedules_are_refused_for_a_reason_not_a_crash():
  """A schedule the partitioner cannot honour is a one-line error, not a wrong program."""
  result = fuzz.check("mlp", "batch=8", "Tile(batch/x, 1, batch); Tile(batch/x, 0, batch)")
  assert result["outcome"] == "refused" and "already sharded over" in result["reason"]


def test_images_split_along_their_width_with_labels_split_by_batch():
  """Found by the fuzzer: XLA left to partition the convolutions computed a wrong filter
  gradient in the jit lowering (error 1.2); the shard_map lowering was exact."""
  result = fuzz.check("resnet", "batch=2,model=4",
                      "Tile(batch/images, 2, batch); Tile(batch/labels, 0, batch)")
  assert result["outcome"] == "ok", result


def test_reshape_merging_a_whole_factor_with_a_split_one():
  """Found by the fuzzer: sequence parallelism on the MoE splits the expert-capacity dimension
  that a reshape merges under a whole one ((8, 2, 16, 4) -> (8, 32, 4)); the plan ran the
  reshape with the split kept, which no local layout can hold (the lowering failed). The split
  factor now runs whole there and the tensor is resharded."""
  result = fuzz.check("moe", "model=8", "SequenceParallel(model)")
  assert result["outcome"] == "ok", result

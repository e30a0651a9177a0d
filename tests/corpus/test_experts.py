"""Expert strategies: every one applies to its family, the key ones run correctly, and the
structural tactics behind them (expert and sequence parallelism) find their targets."""

import math

import pytest

import corpus
import partitioner as P
from corpus.experts import FAMILY_STRATEGIES, GENERIC, STRATEGIES
from partitioner.cost import simulate
from partitioner.verify import verify

MESH = "batch=2,model=4"


@pytest.fixture(scope="module")
def programs():
  cache = {}

  def get(family):
    if family not in cache:
      workload = corpus.load(f"{family}:small")
      cache[family] = (workload, P.trace(workload.fn, *workload.args))
    return cache[family]
  return get


@pytest.mark.slow
@pytest.mark.parametrize("family", list(corpus.FAMILIES))
def test_every_expert_strategy_applies_and_is_costed(family, programs):
  _, program = programs(family)
  schedules = corpus.experts(family, ("batch", "model"))
  assert set(schedules) == set(FAMILY_STRATEGIES[family])
  assert {"dp", "zero1", "zero2", "zero3"} <= set(schedules)
  times = {}
  for name, schedule in schedules.items():
    if name.startswith(("pp+", "ptd-p")) and not program.loops:   # pipelines need a stack
      with pytest.raises(P.ScheduleError, match="found no layer stack"):
        P.apply(program, MESH, schedule)
      continue
    pp = P.apply(program, MESH, schedule)
    assert pp.fallbacks == {}, (family, name)
    report = simulate(pp, "tpu-v4")
    assert math.isfinite(report.step_time_s) and report.step_time_s > 0
    times[name] = report
  # Sharding state over more devices never needs more memory for it.
  for stage in ("zero1", "zero2", "zero3", "hzero2", "hpz"):
    assert times[stage].memory.breakdown["optimizer_state"] < \
        times["dp"].memory.breakdown["optimizer_state"]
  # ...and over fewer devices (hybrid: the model axis only), more.
  assert times["hzero2"].memory.breakdown["optimizer_state"] > \
      times["zero2"].memory.breakdown["optimizer_state"] == \
      times["hpz"].memory.breakdown["optimizer_state"]
  assert times["zero3"].memory.breakdown["parameters"] < times["dp"].memory.breakdown["parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("family,strategy", [
    ("gpt", "dp+megatron+vocab"), ("gpt", "dp+sp"), ("moe", "dp+ep"),
    ("moe", "gshard+hzero2"), ("vmoe", "gshard+hzero2"),
    ("t5", "dp+megatron+zero3"), ("resnet", "zero3"), ("gnn", "dp+megatron"),
    ("ssm", "dp+megatron"), ("unet", "hsdp"), ("bert", "zero2"), ("gpt", "hpz"),
])
def test_expert_strategies_run_correctly(family, strategy, programs):
  workload, program = programs(family)
  pp = P.apply(program, MESH, corpus.experts(family)[strategy])
  result = verify(pp, workload.args)
  assert result.ok, f"{family} {strategy}: max error {result.max_abs_err} in {result.worst}"


def test_expert_parallel_splits_the_expert_dimension(programs):
  _, program = programs("moe")
  pp = P.apply(program, MESH, "BatchParallel(batch); ExpertParallel(model)")
  assert pp.sharding("params/moe/layer_1/experts/w_in").dims == (("model",), (), ())
  assert pp.sharding("params/moe/layer_1/experts/w_out").dims == (("model",), (), ())
  assert pp.sharding("params/moe/layer_0/w_in/w").dims == ((), ())  # dense layers untouched
  with pytest.raises(P.PatternError, match="found no expert weights"):
    P.apply(programs("gpt")[1], MESH, "ExpertParallel(model)")
  with pytest.raises(P.ScheduleError, match="4 experts, not divisible by model=8"):
    P.apply(program, "batch=1,model=8", "ExpertParallel(model)")


@pytest.mark.parametrize("family", ["moe", "vmoe"])
def test_gshard_moves_tokens_to_the_experts_whichever_is_written_first(family, programs):
  """Where the batch and the experts share an axis, the tokens move to the experts at the
  expert matmuls (GShard), not the expert weights to the tokens: ExpertParallel acts before
  the tactics that split the tokens over its axis, also where it is written after them (it
  used to meet tokens split over its axis and have every expert's weights gathered)."""
  workload, program = programs(family)
  schedule = corpus.experts(family)["gshard"]
  experts = f"params/{family}/layer_1/experts"
  assert schedule == "BatchParallel(batch); ExpertParallel(model); BatchParallel(model)"
  gshard = P.apply(program, MESH, schedule)
  reverse = P.apply(program, MESH, "BatchParallel(batch); BatchParallel(model); "
                    "ExpertParallel(model)")

  def resharded_experts(pp):
    return {c.dropped.split(" on ")[0] for c in pp.conflicts if "/experts/" in c.dropped}

  for pp in (gshard, reverse):
    assert resharded_experts(pp).isdisjoint({f"{experts}/w_in", f"{experts}/w_out"})
    assert any("(experts)" in c.kept and not c.dropped.startswith("params/")
               for c in pp.conflicts)   # the tokens are what moves
    assert pp.sharding(f"{experts}/w_in").dims == (("model",), (), ())
  assert [str(t) for t in reverse.schedule] == [
      "BatchParallel(batch)", "ExpertParallel(model)", "BatchParallel(model)"]
  assert "acts before BatchParallel(model)" in reverse.reports[1].notes[-1]
  assert sorted((c.kind, c.axes, c.bytes) for c in reverse.collectives) == sorted(
      (c.kind, c.axes, c.bytes) for c in gshard.collectives)
  result = verify(reverse, workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"


def test_expert_parallel_acts_before_a_tile_of_the_data_or_zero_over_its_axis_too(programs):
  from partitioner.roles import roles
  _, program = programs("moe")
  data = program.name(roles(program).data[0])
  pp = P.apply(program, MESH, f"Tile({data}, 0, model); Tile({data}, 0, batch); "
               "ExpertParallel(model)")
  assert [str(t) for t in pp.schedule] == [
      "ExpertParallel(model)", f"Tile({data}, 0, model)", f"Tile({data}, 0, batch)"]
  # ZeRO splits the batch over its axis where nothing did: the experts act before it too.
  pp = P.apply(program, MESH, "ZeRO(model, stage=1); ExpertParallel(model)")
  assert [str(t) for t in pp.schedule] == ["ExpertParallel(model)", "ZeRO(model, stage=1)"]


def test_expert_parallel_written_late_replays_what_an_auto_before_it_chose(programs):
  from agents.search.auto import solve
  _, program = programs("moe")
  pp = P.apply(program, MESH, "BatchParallel(model); Auto(batch, agent=greedy, budget=4); "
               "ExpertParallel(model)", solver=solve)
  # The Auto is replayed as what it chose, after the experts and the batch over `model`.
  assert [str(t) for t in pp.schedule[:2]] == ["ExpertParallel(model)", "BatchParallel(model)"]
  assert not any(isinstance(t, P.Auto) for t in pp.schedule)
  again = P.apply(program, MESH, pp.decided)
  assert again.decided == pp.decided and again.state.dims == pp.state.dims


def test_sequence_parallel_splits_the_sequence(programs):
  _, program = programs("gpt")
  pp = P.apply(program, MESH, "BatchParallel(batch); SequenceParallel(model)")
  assert pp.sharding("batch/inputs").dims == (("batch",), ("model",))
  assert pp.sharding("batch/targets").dims == (("batch",), ("model",))
  with pytest.raises(P.ScheduleError, match="length 16 along dim 1, not divisible"):
    P.apply(program, "batch=1,model=32", "SequenceParallel(model)")


def test_one_axis_meshes_get_the_one_axis_strategies():
  schedules = corpus.experts("gpt", ("x",))
  assert set(schedules) == {n for n in FAMILY_STRATEGIES["gpt"] if not STRATEGIES[n].two_axes}
  assert schedules["zero3"] == "BatchParallel(x); ZeRO(x, stage=3)"
  assert corpus.experts("moe", ("pod", "data", "expert"))["dp+ep"] == \
      "BatchParallel(pod); BatchParallel(data); ExpertParallel(expert)"


def test_hpz_shards_the_optimizer_state_wider_than_the_parameters():
  """ZeRO++'s hpZ: the state over the data axes (all of them, or the innermost on a mesh of
  three), the parameters over the model axis only, sharded after the state so that the
  parameters' gathers stay inside the model axis."""
  schedules = corpus.experts(None, ("pipe", "data", "model"))
  assert schedules["hpz"] == ("BatchParallel(pipe); BatchParallel(data); BatchParallel(model); "
                              "ZeRO(pipe, stage=2); ZeRO(data, stage=2); ZeRO(model)")
  assert schedules["hpz(data)"] == ("BatchParallel(pipe); BatchParallel(data); "
                                    "BatchParallel(model); ZeRO(data, stage=2); ZeRO(model)")
  assert "hpz(pipe,data)" not in schedules   # that is hpz itself
  with pytest.raises(P.WorkloadError, match="no expert strategies for 'llama'"):
    corpus.experts("llama")


def test_meshes_of_three_and_four_axes_also_shard_over_the_inner_axes_only():
  three = corpus.experts("gpt", ("data", "fsdp", "tensor"))
  assert three["dp+megatron+zero3(fsdp)"] == ("BatchParallel(data); BatchParallel(fsdp); "
                                              "Megatron(tensor); ZeRO(fsdp, stage=3)")
  assert three["zero3(fsdp,tensor)"] == ("BatchParallel(data); BatchParallel(fsdp); "
                                         "BatchParallel(tensor); ZeRO(fsdp, stage=3); "
                                         "ZeRO(tensor, stage=3)")
  assert three["dp+megatron+zero3"].endswith("ZeRO(data, stage=3); ZeRO(fsdp, stage=3)")
  four = corpus.experts(None, ("pod", "data", "fsdp", "tensor"))
  assert {"zero3", "zero3(data,fsdp,tensor)", "zero3(fsdp,tensor)", "hsdp", "dp+megatron+zero3",
          "dp+megatron+zero3(data,fsdp)", "dp+megatron+zero3(fsdp)"} <= set(four)
  # Two axes: the family's strategies as they were; no family: the generic ones.
  assert set(corpus.experts("gpt", ("batch", "model"))) == set(FAMILY_STRATEGIES["gpt"])
  assert set(corpus.experts(None, ("batch", "model"))) == set(GENERIC)
  assert not {"dp+ep", "dp+sp"} & set(GENERIC) and "dp+megatron+vocab" in GENERIC


@pytest.mark.slow
def test_the_three_axis_forms_run_correctly(programs):
  workload, program = programs("gpt")
  mesh = "data=2,fsdp=2,tensor=2"
  schedules = corpus.experts("gpt", P.Mesh.parse(mesh).names)
  result = verify(P.apply(program, mesh, schedules["dp+megatron+zero3(fsdp)"]), workload.args)
  assert result.ok, f"max error {result.max_abs_err} in {result.worst}"

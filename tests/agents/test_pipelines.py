"""Every agent meets pipelines after its episode (`agents.pipelines`): the micro-batch counts
tried, a search agent's pipelined plan replays to the cost it reports, the best pipeline is
tried interleaved, and `propose` answers Megatron-LM's 1T (3,072 A100s, as published) with a
pipelined plan of the shipped policy's."""

import dataclasses
import json
from pathlib import Path

import pytest

import corpus
import partitioner as P
from agents.pipelines import floor_s, microbatch_counts, pipelined
from partitioner.cost import simulate

ROOT = Path(__file__).resolve().parents[2]


def test_micro_batch_counts_divide_the_batch_and_its_data_axes():
  # 1T: 3,072 sequences, 64 stages, 6 data-parallel ranks: the micro-batch counts whose
  # micro-batches divide over 6 are the divisors of 512.
  assert microbatch_counts(3072, 64, 6) == (128, 256, 512)
  assert microbatch_counts(3072, 64, 6, per_stage=(4, 8)) == (256, 512)
  # Where no count divides the data axes, the nearest that divide the batch.
  assert microbatch_counts(16, 2, 3) == (4, 8, 16)
  assert microbatch_counts(7, 2, 1) == (7,)   # the only divisor from 2 to 32
  assert microbatch_counts(7, 8, 1) == ()


def test_a_search_agent_s_pipelined_plan_replays_to_its_cost():
  from environments import PartitioningEnv
  from launch.evaluation import EvalTask, parse_agent, pipelined_plan
  model = "gpt:small,layers=2,scan=true,batch=16"
  task = EvalTask(model, "stage=2,batch=4", "h100", "3MiB")
  env = PartitioningEnv(task.resolve())
  env.reset()                     # the unpartitioned start does not fit 3 MiB
  staged = pipelined_plan(parse_agent("greedy"), env)
  assert staged is not None and staged["fits"]
  assert staged["schedule"].startswith(f"Pipeline(stage, microbatches={staged['microbatches']})")
  assert "Auto" not in staged["schedule"]
  w = corpus.load(model)
  cost = simulate(P.apply(P.trace(w.fn, *w.args), "stage=2,batch=4", staged["schedule"]), "h100")
  assert cost.step_time_s == pytest.approx(staged["step_time_s"], rel=1e-9)
  # No loop, no pipeline.
  env = PartitioningEnv(EvalTask("mlp:small", "stage=2,batch=4", "h100", "device").resolve())
  env.reset()
  assert pipelined_plan(parse_agent("greedy"), env) is None


def test_no_pipeline_runs_faster_than_its_floor_and_none_is_tried_under_it(monkeypatch):
  """A pipelined plan of a scanned GPT, under each schedule, takes at least `floor_s`; a plan
  to beat that fits and is no slower is beaten by none, so nothing is traced for it."""
  from environments.tasks import load_program
  from partitioner import partition
  program = load_program("gpt:small,layers=4,scan=true,batch=32")
  mesh = P.Mesh.parse("stage=2,batch=2,model=2")
  counts = microbatch_counts(32, 2, 2, per_stage=(4,))
  rest = "BatchParallel(batch); Megatron(model)"
  for schedule, virtual in (("gpipe", ()), ("1f1b", ()), ("interleaved", (2,))):
    plan = f"Pipeline(stage, microbatches={counts[0]}, schedule={schedule}" + \
        "".join(f", virtual={v}" for v in virtual) + f"); {rest}"
    step = simulate(P.apply(program, mesh, plan), "h100").step_time_s
    assert step >= floor_s(program, mesh, "h100", counts, virtual)
  hand = [("ptd-p", f"Pipeline(stage); {rest}")]
  best = pipelined(program, mesh, "h100", 80 * 2**30, None, hand=hand, per_stage=(4,),
                   virtual=())
  floor = floor_s(program, mesh, "h100", counts)
  assert best is not None and best.cost.step_time_s > floor
  monkeypatch.setattr(partition.PartitionedProgram, "apply",
                      lambda *a, **k: pytest.fail("a pipeline was traced"))
  beat = dataclasses.replace(best.cost, step_time_s=floor)   # fits, and no slower
  for kwargs in (dict(beat=beat), dict(faster_than=floor)):
    assert pipelined(program, mesh, "h100", 80 * 2**30, None, hand=hand, per_stage=(4,),
                     virtual=(), **kwargs) is None


def test_the_best_pipeline_is_tried_interleaved():
  """Megatron-LM's 76.1B at its published plan (p=4, 28 micro-batches, t=8, d=32), which the
  paper ran with 3 virtual stages: interleaving wins here (the bubble shrinks more than the
  chunks' weight gathers cost), and the plan replays to its cost."""
  from environments.tasks import load_program
  program = load_program(f"{ROOT / 'benchmarks' / 'published.py'}:table1_76_1b")
  mesh = P.Mesh.parse("pipe=4,data=32,model=8")
  hand = [("ptd-p", "Pipeline(pipe); BatchParallel(data); Megatron(model); "
                    "EmbeddingSharding(model)")]
  found = {v: pipelined(program, mesh, "a100-80gb", 80 * 2**30, None, hand=hand,
                        per_stage=(7,), virtual=v) for v in ((), (2, 3))}
  assert found[()].schedule.startswith("Pipeline(pipe, microbatches=28); ")
  best = found[(2, 3)]
  assert best.schedule.startswith(
      "Pipeline(pipe, microbatches=28, schedule=interleaved, virtual=3); ")
  assert best.cost.step_time_s < 0.99 * found[()].cost.step_time_s
  cost = simulate(P.apply(program, mesh, best.schedule), "a100-80gb")
  assert cost.step_time_s == pytest.approx(best.cost.step_time_s, rel=1e-9)


def test_propose_answers_the_1t_model_with_a_pipeline_that_fits(tmp_path):
  """Megatron-LM's 1T on its published 3,072 A100s (pipe=64, data=6, model=8, batch 3,072):
  no plan without pipelines both fits 80 GB and is fast (ZeRO-3 fits at 1.6x the pipelined
  step); a pipeline does: the shipped policy's over the data and model axes, or Megatron-LM's
  `ptd-p`, which it ties with here."""
  from launch.cli import main
  out = tmp_path / "p.json"
  model = f"{ROOT / 'benchmarks' / 'published.py'}:table1_1008_0b"
  assert main(["propose", model, "--mesh", "pipe=64,data=6,model=8", "--hardware", "a100-80gb",
               "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["fits"] and result["winner"] in ("policy", "ptd-p", "ptd-p+zero1")
  assert result["answer"].startswith("Pipeline(pipe, microbatches=")
  assert "Auto" not in result["answer"]
  zero3 = next(h for h in result["hand_schedules"] if h["name"] == "zero3")
  assert result["cost"]["step_time_s"] < zero3["step_time_s"] / 1.5
  assert result["cost"]["peak_memory_bytes"] <= 80 * 2**30


def test_the_expert_agent_costs_the_pipelining_hand_schedules():
  from environments import PartitioningEnv
  from launch.evaluation import EvalTask, parse_agent, pipelined_plan
  model = "gpt:small,layers=2,scan=true,batch=16"
  env = PartitioningEnv(EvalTask(model, "stage=2,batch=4", "h100", "3MiB").resolve())
  env.reset()                     # the unpartitioned start does not fit 3 MiB
  staged = pipelined_plan(parse_agent("expert"), env)
  assert staged is not None and staged["fits"]
  assert staged["schedule"].startswith(f"Pipeline(stage, microbatches={staged['microbatches']})")
  w = corpus.load(model)
  cost = simulate(P.apply(P.trace(w.fn, *w.args), "stage=2,batch=4", staged["schedule"]), "h100")
  assert cost.step_time_s == pytest.approx(staged["step_time_s"], rel=1e-9)

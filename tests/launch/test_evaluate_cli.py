"""`shardzero evaluate`: agents x tasks, ratios to the best known, the results store, errors."""

import csv
import json
import os

import pytest

import corpus

from tests.launch.test_cli import run

SUITE = """\
description: two tiny tasks
agents: [greedy, random, "mcts:8"]
tasks:
  - models: ["mlp:small"]
    meshes: ["batch=8", "batch=4,model=2"]
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
  path = tmp_path_factory.mktemp("suite") / "tiny.yaml"
  path.write_text(SUITE)
  return str(path)


def _evaluate(capsys, *argv):
  code, out, err = run(capsys, "evaluate", *argv, "--json", "-")
  return code, (json.loads(out) if code == 0 else None), err


DIES = """\
import multiprocessing, os, signal
from tests.partitioner.user_models import scanned_decoder

def step():
  if multiprocessing.parent_process() is not None:   # in an evaluation worker: killed, as for memory
    os.kill(os.getpid(), signal.SIGKILL)
  return scanned_decoder()
"""


def test_a_worker_killed_is_one_line_and_keeps_what_finished(capsys, tmp_path):
  model = tmp_path / "dies.py"
  model.write_text(DIES)
  store = tmp_path / "results.jsonl"
  code, _, err = run(capsys, "evaluate", "--models", f"{model}:step", "--meshes", "batch=8",
                     "--agents", "greedy", "--store", str(store), "--jobs", "2")
  assert code == 2
  assert "a worker process died" in err and "fewer --jobs" in err and str(store) in err


def test_parallel_jobs_ratios_and_resume(capsys, suite, tmp_path):
  store = str(tmp_path / "results.jsonl")
  code, data, _ = _evaluate(capsys, "--suite", suite, "--store", store, "--jobs", "2")
  assert code == 0
  rows = data["results"]
  assert len(rows) == 2 * 3 and data["agents"] == ["greedy", "random", "mcts:8"]
  assert {r["mesh"] for r in rows} == {"batch=8", "batch=4,model=2"}
  with open(store) as f:
    stored = [json.loads(line) for line in f]
  assert len(stored) == 2 * 4                    # the expert is evaluated on corpus models too
  for task in data["tasks"]:
    times = [r["step_time_s"] for r in stored if r["task"] == task and r["fits"]]
    mine = [r for r in rows if r["task"] == task]
    assert min(r["ratio"] for r in mine) >= 1.0 - 1e-12
    assert all(r["best_known_s"] == min(times) for r in mine)
    assert all(r["ratio"] == pytest.approx(r["step_time_s"] / min(times)) for r in mine)
    assert next(r for r in mine if r["agent"] == "mcts:8")["simulations"] == 8
  assert {s["devices"] for s in data["summary"]} == {8}
  assert all(s["tasks"] == 2 and s["errors"] == 0 for s in data["summary"])
  # A re-run evaluates nothing and reports the same; a new agent adds only its own rows.
  code, again, _ = _evaluate(capsys, "--suite", suite, "--store", store)
  assert code == 0 and again["results"] == rows
  code, more, _ = _evaluate(capsys, "--suite", suite, "--store", store,
                            "--agents", "greedy,beam:20")
  assert code == 0 and len(more["results"]) == 4
  with open(store) as f:
    assert len(f.readlines()) == 2 * 4 + 2
  # A result costed by an earlier cost model is neither reused nor the best known.
  from partitioner.cost import COST_MODEL_VERSION
  old = dict(stored[0], version=stored[0]["version"].replace(f"-c{COST_MODEL_VERSION}", "-c1"),
             step_time_s=stored[0]["step_time_s"] / 10)
  with open(store, "a") as f:
    f.write(json.dumps(old) + "\n")
  code, again, _ = _evaluate(capsys, "--suite", suite, "--store", store)
  assert code == 0 and again["results"] == rows


def test_tables_csv_plots_and_markdown(capsys, tmp_path):
  store, out_dir = str(tmp_path / "r.jsonl"), tmp_path / "out"
  code, out, _ = run(capsys, "evaluate", "--models", "mlp:small", "--meshes",
                     "batch=8;batch=2,model=4", "--agents", "expert,greedy", "--store", store,
                     "--csv", str(tmp_path / "r.csv"), "--plots", str(out_dir),
                     "--markdown", str(tmp_path / "report.md"))
  assert code == 0
  assert "8 devices: step time / best known" in out and "summary" in out
  with open(tmp_path / "r.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 4 and {r["agent"] for r in rows} == {"expert", "greedy"}
  assert all(float(r["ratio"]) >= 1.0 - 1e-12 for r in rows)
  assert sorted(os.listdir(out_dir)) == ["decision_time.png", "ratio_by_devices.png",
                                         "ratio_by_size.png"]
  text = (tmp_path / "report.md").read_text()
  assert "| greedy | 8 | 2 |" in text and "](out/ratio_by_devices.png)" in text


def test_ilp_rows_carry_the_solver_report(capsys, tmp_path):
  code, data, _ = _evaluate(capsys, "--models", "mlp:small", "--meshes", "batch=4,model=2",
                            "--agents", "ilp:20", "--store", str(tmp_path / "r.jsonl"))
  assert code == 0
  (row,) = data["results"]
  ilp = row["ilp"]
  assert ilp["variables"] > 0 and ilp["constraints"] > 0 and "Optimal" in ilp["status"]
  assert ilp["simulated_s"] > 0 and ilp["objective_s"] > 0
  assert row["ratio"] <= 1.10 and row["fits"]


def test_a_damaged_store_line_is_skipped_with_a_warning(capsys, tmp_path):
  store = tmp_path / "r.jsonl"
  argv = ("--models", "mlp:small", "--meshes", "batch=8", "--agents", "greedy", "--store",
          str(store))
  assert _evaluate(capsys, *argv)[0] == 0
  # A line of something else, and a crash mid-line.
  store.write_text(store.read_text() + '{"agent": "greedy"}\n{"agent": "greedy", "vers')
  code, data, err = _evaluate(capsys, *argv)
  assert code == 0 and "2 damaged line(s)" in err and len(data["results"]) == 1
  assert data["results"][0]["ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, message", [
    (["--models", "gtp:mini", "--meshes", "batch=8"], "unknown model 'gtp:mini'"),
    (["--models", "gpt:huge", "--meshes", "batch=8"], "gpt has no preset 'huge'"),
    (["--models", "mlp:small", "--meshes", "batch=8", "--agents", "alphago"],
     "unknown agent 'alphago'"),
    (["--models", "mlp:small", "--meshes", "batch=8", "--agents", "mcts:0"],
     "agent 'mcts:0': mcts takes a positive integer"),
    (["--models", "mlp:small", "--meshes", "batch=8", "--agents", "policy:nowhere"],
     "no checkpoint nowhere/checkpoint.ckpt"),
    (["--models", "mlp:small", "--meshes", "batch"], "bad mesh 'batch'"),
    (["--models", "mlp:small", "--meshes", "batch=8", "--memory-budget", "lots"],
     "bad memory size 'lots'"),
    (["--models", "mlp:small", "--meshes", "batch=8", "--hardware", "tpu-v9"],
     "unknown hardware 'tpu-v9'"),
    (["--suite", "nosuch"], "unknown suite 'nosuch'"),
    (["--models", "mlp:small"], "give --suite, or --models and --meshes"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, argv, message):
  code, _, err = run(capsys, "evaluate", *argv, "--store", str(tmp_path / "r.jsonl"))
  assert code == 2
  assert err.count("\n") == 1 and message in err, err


def test_models_keep_their_knobs_when_split():
  from launch.evaluate_command import split_models
  assert split_models("heldout,gpt:350m,batch=256;t5:mini") == [
      "heldout", "gpt:350m,batch=256", "t5:mini"]
  assert split_models("gpt:mini,batch=8,seq=64,mlp:small") == ["gpt:mini,batch=8,seq=64",
                                                              "mlp:small"]
  assert split_models("mlp:small;batch=8") == ["mlp:small", "batch=8"]   # then: unknown model


def test_summary_counts_only_fitting_results_within_10pct_and_filters_by_split():
  from launch.evaluation import summarize, with_ratios
  row = lambda agent, model, step, fits: {"agent": agent, "task": model, "model": model,
                                           "devices": 64, "step_time_s": step, "fits": fits,
                                           "decide_s": 1.0}
  rows = with_ratios([row("a", "t5:mini", 1.05, True), row("a", "gpt:mini", 2.0, True),
                      row("b", "t5:mini", 1.0, False), row("b", "gpt:mini", 1.0, True)],
                     {"t5:mini": 1.0, "gpt:mini": 1.0})
  (a, b) = summarize(rows)
  assert (a["agent"], a["mean_ratio"], a["within_10pct"]) == ("a", 1.525, 0.5)
  assert (b["agent"], b["mean_ratio"], b["within_10pct"]) == ("b", 1.0, 0.5)   # over budget
  (a, b) = summarize(rows, "heldout")                                         # t5 only
  assert (a["tasks"], a["mean_ratio"], b["within_10pct"]) == (1, 1.05, 0.0)
  # Where no plan fits, ratios compare plans that do not: that task is counted apart.
  rows = with_ratios([row("a", "t5:mini", 1.05, True), row("a", "moe:mini", 0.5, False)],
                     {"t5:mini": 1.0, "moe:mini": 1.0}, feasible={"t5:mini"})
  (a,) = summarize(rows)
  assert (a["tasks"], a["nothing_fits"], a["mean_ratio"], a["worst_ratio"]) == (2, 1, 1.05, 1.05)
  from launch.evaluation import split_of
  assert [split_of(m) for m in ("gpt:mini", "t5:mini", "hf_gpt2:mini", "hf_llama:1b",
                                "tests/launch/user_model.py:workload")] == \
      ["train", "heldout", "real", "external", "user"]


def test_a_user_model_gets_the_generic_hand_schedules_as_its_expert(capsys, tmp_path):
  code, data, _ = _evaluate(capsys, "--models", "tests/launch/user_model.py:workload",
                            "--meshes", "batch=2", "--agents", "expert,greedy",
                            "--store", str(tmp_path / "r.jsonl"))
  assert code == 0
  rows = {r["agent"]: r for r in data["results"]}
  assert set(rows) == {"expert", "greedy"}
  assert all("error" not in r for r in rows.values())
  assert rows["expert"]["schedule"] in corpus.experts(None, ("batch",)).values()
  assert min(r["ratio"] for r in rows.values()) == 1.0


@pytest.mark.slow   # three plans costed with micro-batches: the pinned lane runs it
def test_the_guarded_policy_answers_as_propose_does_with_micro_batches(capsys, tmp_path):
  """Where no whole-batch plan fits, `policy+guard` is scored on the plan `propose` answers:
  one that fits once its batch is cut into micro-batches."""
  import policies
  model, mesh = "gpt:mini,batch=8", "batch=4,model=2"
  code, out, _ = run(capsys, "propose", model, "--mesh", mesh, "--memory-budget", "1KiB",
                     "--json", "-")
  proposed = json.loads(out)
  plan = proposed["policy_plan"]   # its own line over the budget: cut or recomputed
  whole = [] if plan["schedule"].startswith(("Microbatch(", "Remat()")) else [
      plan["peak_memory_bytes"]]
  smallest = min([h["peak_memory_bytes"] for h in proposed["hand_schedules"]
                  if "step_time_s" in h] + whole)
  budget = str(int(smallest * 0.9))
  code, out, _ = run(capsys, "propose", model, "--mesh", mesh, "--memory-budget", budget,
                     "--json", "-")
  proposed = json.loads(out)
  code, data, err = _evaluate(capsys, "--models", model, "--meshes", mesh, "--memory-budget",
                              budget, "--agents", f"policy+guard:{policies.DEFAULT}",
                              "--store", str(tmp_path / "r.jsonl"))
  assert code == 0, err
  (row,) = data["results"]
  assert row["fits"] and row["microbatched"]["k"] == proposed["microbatches"]
  assert row["schedule"] == proposed["answer"]
  assert row["step_time_s"] == pytest.approx(proposed["cost"]["step_time_s"])


def test_a_unit_leaves_no_task_contexts_behind():
  """A process evaluating tasks one after another keeps each task's contexts (their cached
  states) only while its agents play: kept, they grew the external suite's run past 22 GB.
  The traced program stays shared with the next task of the same model."""
  from environments.tasks import TASKS
  from launch.evaluation import EvalTask, Unit, agent_version, parse_agent, run_unit
  task = EvalTask("mlp:mini", "batch=2,model=4", "h100", "device")
  agents = tuple((a, agent_version(parse_agent(a))) for a in ("expert", "greedy"))
  rows = run_unit(Unit(task, agents, 8, 0))
  assert [r["agent"] for r in rows] == ["expert", "greedy"]
  assert all("error" not in r and r["step_time_s"] > 0 for r in rows)
  assert len(TASKS.contexts) == 0 and len(TASKS.programs) > 0


@pytest.mark.slow   # on the pinned stack only
def test_the_ilp_meets_pipelines_where_the_step_has_a_scanned_stack():
  """Pipelines rewrite the program the environment is built on, so the ILP agent tries them
  after its episode: a `Pipeline` over the outermost axis, the ILP over the others. Asked
  from the unpartitioned start, which does not fit 3 MiB, it answers with a pipelined plan
  that does, and the schedule replays to the cost it reports."""
  from environments import PartitioningEnv
  from launch.evaluation import EvalTask, parse_agent, pipelined_plan
  from partitioner.cost import simulate
  import partitioner as P
  task = EvalTask("gpt:small,layers=2,scan=true,batch=16", "stage=2,batch=4", "h100", "3MiB")
  env = PartitioningEnv(task.resolve())
  env.reset()
  staged = pipelined_plan(parse_agent("ilp:4"), env, 4)
  assert staged is not None and staged["fits"]
  assert staged["schedule"].startswith("Pipeline(stage, microbatches=")
  w = corpus.load("gpt:small,layers=2,scan=true,batch=16")
  program = P.trace(w.fn, *w.args)
  cost = simulate(P.apply(program, "stage=2,batch=4", staged["schedule"]), "h100")
  assert cost.step_time_s == pytest.approx(staged["step_time_s"], rel=1e-9)
  # No loop, no pipeline.
  env = PartitioningEnv(EvalTask("mlp:small", "stage=2,batch=4", "h100", "device").resolve())
  env.reset()
  assert pipelined_plan(parse_agent("ilp:4"), env, 4) is None


def test_plans_of_an_earlier_cost_model_are_priced_again_into_the_best_known(capsys, tmp_path,
                                                                            monkeypatch):
  """The best known counts only rows of the current cost model; a plan an earlier model found
  best is priced again under this one (a `replay:` row, in no table), so that a cost model's
  bump does not drop it and flatter every other agent. Once per plan; a schedule that no
  longer applies is left out."""
  from launch.evaluation import ResultsStore
  from partitioner import apply
  from partitioner.cost import COST_MODEL_VERSION, simulate
  from environments.tasks import load_program
  store = tmp_path / "r.jsonl"
  argv = ("--models", "mlp:small", "--meshes", "batch=4,model=2", "--agents", "expert",
          "--store", str(store))
  code, data, _ = _evaluate(capsys, *argv)
  assert code == 0
  expert = data["results"][0]
  plan = "BatchParallel(batch); Megatron(model)"
  old = [{**expert, "agent": "ilp:60", "version": "ilp-v9-c1", "schedule": plan,
          "step_time_s": 1e-9},
         {**expert, "agent": "mcts:100", "version": "mcts-v3-c1", "step_time_s": 2e-9,
          "schedule": "Tile(params/nothing/*, 0, model)"}]   # matches nothing now
  with open(store, "a") as f:
    for row in old:
      f.write(json.dumps({k: v for k, v in row.items()
                          if k not in ("ratio", "within", "best_known_s", "feasible")}) + "\n")
  code, data, err = run(capsys, "evaluate", *argv)
  assert code == 0 and "1 plan(s) of earlier cost models priced again" in err
  replays = [r for r in ResultsStore(str(store)).rows if r["agent"].startswith("replay:")]
  assert [(r["agent"], r["schedule"], r["replayed"]) for r in replays] == [
      ("replay:ilp:60", plan, "ilp-v9-c1")]
  priced = simulate(apply(load_program("mlp:small"), "batch=4,model=2", plan), "h100")
  assert replays[0]["step_time_s"] == pytest.approx(priced.step_time_s)
  best = ResultsStore(str(store)).best_known()[expert["task"]]
  assert best == pytest.approx(min(expert["step_time_s"], priced.step_time_s))
  code, _, err = run(capsys, "evaluate", *argv)   # priced once
  assert code == 0 and "priced again" not in err
  assert len([r for r in ResultsStore(str(store)).rows if r["agent"].startswith("replay:")]) == 1
  # Under the next cost model the replay is replayed as the ILP's plan, not as a replay's.
  import launch.evaluation as ev
  with open(store, "a") as f:   # the replay priced fastest: the one to replay next
    f.write(json.dumps({**replays[0], "step_time_s": 1e-12}) + "\n")
  monkeypatch.setattr(ev, "_cost_model_version", lambda: COST_MODEL_VERSION + 1)
  code, _, err = run(capsys, "evaluate", *argv)
  assert code == 0 and "priced again" in err
  again = [r for r in ResultsStore(str(store)).rows
           if r["agent"].startswith("replay:") and r["schedule"] == plan][-1]
  assert again["version"] == f"replay-v1-c{COST_MODEL_VERSION + 1}"
  assert (again["agent"], again["replayed"]) == ("replay:ilp:60", "ilp-v9-c1")

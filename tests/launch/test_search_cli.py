"""`shardzero search`: the schedule found, its cost beside the best expert's, JSON, errors."""

import json

import pytest

from tests.launch.test_cli import run

GPT = "gpt:small,d_model=512,heads=8,vocab=8192,seq=256,batch=32"


@pytest.mark.slow
def test_search_json_fields_and_replayable_schedule(capsys):
  code, out, _ = run(capsys, "search", GPT, "--mesh", "batch=4,model=8", "--memory-budget",
                     "100MiB", "--agent", "mcts", "--budget", "60", "--json", "-")
  assert code == 0
  data = json.loads(out)
  assert {"schedule", "cost", "expert", "search_time_s", "simulations"} <= set(data)
  assert data["simulations"] == 60 and data["search_time_s"] > 0
  assert {"step_time_s", "compute_s", "comm_s", "peak_memory_bytes", "fits",
          "decompositions"} <= set(data["cost"])
  assert data["cost"]["memory_budget_bytes"] == 100 * 2**20
  assert data["expert"]["name"] and data["expert"]["cost"]["within_budget"]
  assert data["cost"]["within_budget"]
  code, out, _ = run(capsys, "partition", GPT, "--mesh", "batch=4,model=8", "--tactics",
                     data["schedule"], "--json", "-")
  assert code == 0
  assert json.loads(out)["cost"]["step_time_s"] == pytest.approx(data["cost"]["step_time_s"])


@pytest.mark.slow
def test_search_on_a_folded_model_reports_the_whole_program(capsys):
  deep = "gpt:small,layers=6,d_model=256,seq=64,batch=16"
  code, out, _ = run(capsys, "search", deep, "--mesh", "batch=2,model=4", "--agent", "mcts",
                     "--budget", "20", "--json", "-")
  assert code == 0
  data = json.loads(out)
  code, out, _ = run(capsys, "partition", deep, "--mesh", "batch=2,model=4", "--tactics",
                     data["schedule"], "--json", "-")
  assert code == 0
  whole = json.loads(out)["cost"]
  assert data["cost"]["step_time_s"] == pytest.approx(whole["step_time_s"], rel=1e-9)
  assert data["cost"]["peak_memory_bytes"] == whole["peak_memory_bytes"]
  code, out, _ = run(capsys, "partition", deep, "--mesh", "batch=2,model=4", "--tactics",
                     data["expert"]["schedule"], "--json", "-")
  assert json.loads(out)["cost"]["step_time_s"] == pytest.approx(
      data["expert"]["cost"]["step_time_s"], rel=1e-9)


def test_search_prints_the_comparison(capsys):
  code, out, _ = run(capsys, "search", "mlp:small", "--mesh", "batch=4,model=2",
                     "--agent", "greedy")
  assert code == 0
  assert "schedule:" in out and "best expert" in out and "unpartitioned" in out


@pytest.mark.parametrize("argv, message", [
    (["mlp:small", "--mesh", "batch=8", "--memory-budget", "lots"], "bad memory size"),
    (["mlp:small", "--mesh", "batch=8", "--budget", "0"], "must be positive"),
    (["mlp:small,width=x", "--mesh", "batch=8"], "width"),
    (["mlp:small", "--mesh", "batch=8", "--hardware", "abacus"], "abacus"),
])
def test_search_bad_input_is_one_line(capsys, argv, message):
  code, out, err = run(capsys, "search", *argv)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_expert_agent_plays_the_generic_hand_schedules_on_a_users_model(capsys):
  import corpus
  code, out, err = run(capsys, "search", "tests/launch/user_model.py:workload", "--mesh",
                       "batch=8", "--agent", "expert", "--json", "-")
  data = json.loads(out)
  assert code == 0, err
  assert data["schedule"] == data["expert"]["schedule"]
  assert data["expert"]["name"] in corpus.experts(None, ("batch",))

"""The same command with the same seed gives the same JSON, byte for byte, once the fields that
measure wall-clock time are set aside (they say how long deciding took, not what was decided).
`propose` is checked with a trained policy in tests/launch/test_train.py."""

import json

import pytest

from tests.launch.test_cli import run

# Keys whose values are wall-clock measurements.
WALL_CLOCK = {"timing_s", "search_time_s", "policy_time_s", "decide_s", "mean_decide_s", "build_s",
              "solve_s", "guard_time_s", "policy_s", "guard_s", "fit_time_s", "decide_time_s"}


def without_wall_clock(tree):
  if isinstance(tree, dict):
    return {k: without_wall_clock(v) for k, v in tree.items() if k not in WALL_CLOCK}
  if isinstance(tree, list):
    return [without_wall_clock(v) for v in tree]
  return tree


def twice(capsys, tmp_path, *argv) -> tuple[str, str]:
  outs = []
  for k in range(2):
    path = tmp_path / f"{k}.json"
    code, _, err = run(capsys, *argv, "--json", str(path))
    assert code == 0, err
    outs.append(json.dumps(without_wall_clock(json.loads(path.read_text())), sort_keys=True))
  return outs[0], outs[1]


def test_partition_is_deterministic(capsys, tmp_path):
  a, b = twice(capsys, tmp_path, "partition", "gpt:small", "--mesh", "batch=2,model=4",
               "--tactics", "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1)")
  assert a == b


@pytest.mark.parametrize("agent", ["mcts", "beam", "greedy", "random", "expert"])
def test_search_with_every_agent_is_deterministic(capsys, tmp_path, agent):
  a, b = twice(capsys, tmp_path, "search", "mlp:small", "--mesh", "batch=4,model=2",
               "--agent", agent, "--budget", "12", "--seed", "3")
  assert a == b


@pytest.mark.slow
def test_evaluate_is_deterministic(capsys, tmp_path):
  outs = []
  for k in range(2):   # a store of its own each time, or the second run would only read
    path = tmp_path / f"{k}.json"
    code, _, err = run(capsys, "evaluate", "--models", "mlp:small", "--meshes", "batch=4,model=2",
                       "--agents", "expert,random,greedy,beam:8,mcts:8,ilp",
                       "--store", str(tmp_path / f"store{k}.jsonl"), "--json", str(path),
                       "--seed", "5")
    assert code == 0, err
    outs.append(json.dumps(without_wall_clock(json.loads(path.read_text())), sort_keys=True))
  assert outs[0] == outs[1]

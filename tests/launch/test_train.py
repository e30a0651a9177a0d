"""`shardzero train` as separate processes over a real Reverb server on localhost, resume,
`propose` from the checkpoint, `plot`, and bad input."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import reverb

from learners.run_config import RunConfig
from tests.launch.test_cli import run

pytestmark = pytest.mark.slow   # training runs over Reverb

CONFIG = RunConfig(models=("mlp:mini",), heldout=("mlp:mini",), meshes=("batch=4,model=2",),
                   budget_fractions=(None,), max_steps=4, steps=3, actors=1,
                   sizes=(256, 512, 128), variable_update_period=2,
                   settings={"batch_size": 2, "sequence_length": 2, "ema_decay": 0.5})


def _train(run_dir, address, *extra, timeout=400):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  return subprocess.run([sys.executable, "-m", "launch.cli", "train", "--run-dir", str(run_dir),
                         "--reverb", address, "--no-evaluator", *extra], env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A learner process and an actor process for 3 updates, then resumed to 5."""
  run_dir = tmp_path_factory.mktemp("run")
  CONFIG.save(str(run_dir))
  server = reverb.Server(CONFIG.builder().make_replay_tables())
  address = f"localhost:{server.port}"
  client = reverb.Client(address)
  first = _train(run_dir, address, "--resume")
  versions = [int(np.asarray(next(client.sample("params", emit_timesteps=False)).data[-1])[0])]
  second = _train(run_dir, address, "--resume", "--steps", "5")
  for table in ("params", "average_params"):
    versions.append(int(np.asarray(next(client.sample(table, emit_timesteps=False))
                                   .data[-1])[0]))
  server.stop()
  return run_dir, first, second, versions


def _rows(path):
  import csv
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def test_two_processes_train_publish_versions_and_resume_without_loss(trained):
  run_dir, first, second, versions = trained
  assert first.returncode == 0, first.stderr[-2000:]
  assert second.returncode == 0, second.stderr[-2000:]
  assert versions == [3, 5, 5]     # the parameter average is published with the parameters
  learner = _rows(run_dir / "logs" / "learner.csv")
  assert [int(float(r["steps"])) for r in learner] == [1, 2, 3, 4, 5]
  assert all(float(r["policy_lag"]) >= 0 for r in learner)
  episodes = _rows(run_dir / "logs" / "actor_0.csv")
  counts = [int(float(r["episodes"])) for r in episodes]
  assert counts == list(range(1, len(counts) + 1))      # the resumed actor kept counting
  seen = [int(r["version"]) for r in episodes]
  assert seen[-1] > 0
  from learners import checkpointing
  saved = checkpointing.load(str(run_dir))
  assert int(saved["learner"]["state"][2]) == 5 and saved["learner"]["counts"]["steps"] == 5
  assert os.listdir(run_dir / "tb" / "learner")


def _processes_mentioning(text: str) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if text.encode() in f.read():
          pids.append(int(entry))
    except (OSError, ValueError):
      pass
  return pids


def test_sigterm_stops_every_role_and_keeps_the_checkpoint(tmp_path):
  """The launcher (its own Reverb server, a learner, an actor) under `kill`: every process it
  started is gone, the checkpoint is there, and it says how to resume."""
  import signal
  import time
  run_dir = tmp_path / "killed"
  dataclasses.replace(CONFIG, steps=100000).save(str(run_dir))
  launcher = subprocess.Popen(
      [sys.executable, "-m", "launch.cli", "train", "--run-dir", str(run_dir), "--resume",
       "--no-evaluator"], env=dict(os.environ, PYTHONPATH=os.getcwd()),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  learner_csv = run_dir / "logs" / "learner.csv"
  deadline = time.time() + 300
  while not (learner_csv.exists() and _rows(learner_csv)) and time.time() < deadline:
    time.sleep(1)
  assert learner_csv.exists() and _rows(learner_csv), "the learner never updated"
  assert len(_processes_mentioning(str(run_dir))) >= 4   # launcher, replay, learner, actor
  launcher.send_signal(signal.SIGTERM)
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 130, err[-2000:]
  assert f"--run-dir {run_dir} --resume" in err
  assert _processes_mentioning(str(run_dir)) == []
  from learners import checkpointing
  assert checkpointing.load(str(run_dir))["learner"]["counts"]["steps"] >= 1


def test_propose_uses_the_checkpoint(trained, capsys, tmp_path):
  run_dir = trained[0]
  code, out, err = run(capsys, "propose", "mlp:mini", "--mesh", "batch=4,model=2", "--policy",
                       str(run_dir), "--json", "-")
  assert code == 0, err
  data = json.loads(out)
  assert data["policy_version"] == 5 and data["policy_time_s"] > 0
  assert data["expert"]["name"] and data["cost_ratio_to_expert"] > 0
  code, out, err = run(capsys, "propose", "mlp:mini", "--mesh", "batch=4,model=2", "--policy",
                       str(run_dir), "--search", "mcts", "--budget", "6", "--json", "-")
  data = json.loads(out)
  assert code == 0 and 0 < data["simulations"] <= 6
  assert data["score"] >= 0            # the search keeps the start if nothing beats it
  code, out, err = run(capsys, "propose", "mlp:mini", "--mesh", "batch=4,model=2", "--policy",
                       str(tmp_path))
  assert code == 2 and "not a training run" in err


def test_guided_search_is_never_worse_than_greedy(trained):
  from agents.decoding import play_policy
  from learners.policies import load_policy
  from environments import PartitioningEnv, Task
  policy = load_policy(str(trained[0]))
  task = Task("gpt:mini", "batch=4,model=2")
  greedy = PartitioningEnv(task, config=CONFIG.env_config())
  greedy.reset()
  play_policy(greedy, policy, "greedy")
  for budget in (1, 4):
    env = PartitioningEnv(task, config=CONFIG.env_config())
    env.reset()
    _, simulations = play_policy(env, policy, "mcts", budget)
    assert env.done and simulations == budget
    assert env.score() >= greedy.score() - 1e-12


def test_propose_verifies_and_refuses_a_damaged_checkpoint(trained, capsys, tmp_path):
  run_dir = trained[0]
  code, out, err = run(capsys, "propose", "mlp:small", "--mesh", "batch=4,model=2", "--policy",
                       str(run_dir), "--verify")
  assert code == 0 and "verify: OK" in out
  import shutil
  copy = tmp_path / "copy"
  shutil.copytree(run_dir, copy)
  path = copy / "checkpoint.ckpt"
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  code, out, err = run(capsys, "propose", "mlp:mini", "--mesh", "batch=4,model=2", "--policy",
                       str(copy))
  assert code == 2 and "damaged" in err


def test_auto_plays_the_policy_inside_a_manual_schedule(trained, capsys):
  run_dir = trained[0]
  schedule = f"BatchParallel(batch); Auto(model, policy='{run_dir}')"
  code, out, err = run(capsys, "partition", "mlp:mini", "--mesh", "batch=4,model=2",
                       "--tactics", schedule, "--json", "-")
  assert code == 0, err
  auto = json.loads(out)["tactics"][1]
  assert auto["tactic"].startswith("Auto(")
  assert auto["notes"][-1].startswith("chose: ")
  assert {a for _, _, axes in auto["targets"] for a in axes} <= {"model"}
  code, out, err = run(capsys, "partition", "mlp:mini", "--mesh", "batch=4,model=2",
                       "--tactics", f"Auto(model, policy='{run_dir}', agent=beam)")
  assert code == 2 and "greedy (decoding) or mcts" in err


def test_plot_draws_the_curves(trained, capsys, tmp_path):
  out_png = tmp_path / "c.png"
  code, out, err = run(capsys, "plot", str(trained[0]), "--out", str(out_png))
  assert code == 0 and out_png.read_bytes()[:4] == b"\x89PNG"
  code, out, err = run(capsys, "plot", str(tmp_path))
  assert code == 2 and "no training logs" in err


def test_plot_compares_the_evaluator_curves_of_several_runs(capsys, tmp_path):
  import matplotlib.pyplot as plt
  from launch.plot_command import comparison
  runs = []
  for seed, ratios in ((0, (2.0, 1.1)), (1, (2.2, 1.3))):
    logs = tmp_path / f"seed{seed}" / "logs"
    logs.mkdir(parents=True)
    rows = [f"{v},0,{r},{r + 0.1},{r - 0.2}" for v, r in zip((0, 10), ratios)]
    (logs / "evaluator.csv").write_text(
        "version,time,heldout_cost_ratio,heldout_tight_cost_ratio,train_median_cost_ratio\n"
        + "\n".join(rows) + "\n")
    runs.append(str(tmp_path / f"seed{seed}"))
  code, out, err = run(capsys, "plot", *runs)
  png = tmp_path / "seed0" / "compare.png"
  assert code == 0 and out.strip() == str(png) and png.read_bytes()[:4] == b"\x89PNG"
  fig = comparison(runs)
  lines = {(ax.get_title(), line.get_label()): list(line.get_ydata())
           for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}
  plt.close(fig)
  assert lines[("held-out mean", "seed1")] == [2.2, 1.3]
  assert np.allclose(lines[("train models, median", "seed0")], [1.8, 0.9])
  (tmp_path / "empty").mkdir()
  code, out, err = run(capsys, "plot", runs[0], str(tmp_path / "empty"))
  assert code == 2 and "no evaluator log" in err
  code, out, err = run(capsys, "plot", runs[0], str(tmp_path / "missing"))
  assert code == 2 and "no run directory" in err


def test_train_rejects_bad_input(capsys, tmp_path):
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "a"), "--set", "nonsense=1")
  assert code == 2 and "unknown ppo settings" in err
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "b"), "--meshes", "batch=x")
  assert code == 2
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "b"), "--models",
                     "gpt:mini; gtp:mini")
  assert code == 2 and "unknown model family 'gtp'" in err
  CONFIG.save(str(tmp_path / "c"))
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "c"))
  assert code == 2 and "--resume" in err
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "c"), "--role", "learner")
  assert code == 2 and "--reverb" in err


def test_learner_pretrains_by_cloning_the_expert(tmp_path):
  """Pretraining updates clone the best expert's demonstrations (no actor needed): afterwards
  the greedy policy plays the expert's schedule."""
  import signal
  from agents.alphazero.demonstrations import demonstration_moves
  from agents.decoding import play_policy
  from learners.policies import load_policy
  from environments import PartitioningEnv, Task
  from launch.training import run_learner
  steps = 150
  config = dataclasses.replace(CONFIG, algorithm="alphazero", steps=steps, settings={
      "batch_size": 4, "pretrain_steps": steps, "learning_rate": 3e-3})
  config.save(str(tmp_path))
  server = reverb.Server(config.builder().make_replay_tables())
  handler = signal.getsignal(signal.SIGTERM)
  try:
    assert run_learner(config, str(tmp_path), f"localhost:{server.port}") == steps
  finally:
    signal.signal(signal.SIGTERM, handler)
    server.stop()
  learner = _rows(tmp_path / "logs" / "learner.csv")
  assert len(learner) == steps and all(float(r["policy_lag"]) == 0 for r in learner)
  assert float(learner[-1]["policy_loss"]) < 0.5 * float(learner[0]["policy_loss"])
  task = Task("mlp:mini", "batch=4,model=2")
  expert = PartitioningEnv(task, config=config.env_config())
  expert.reset()
  moves = demonstration_moves(expert)
  env = PartitioningEnv(task, config=config.env_config())
  env.reset()
  play_policy(env, load_policy(str(tmp_path)), "greedy")
  assert list(env.history) == moves


def test_actors_wait_for_the_cloning_to_end(tmp_path):
  """With pretrain_steps, an actor writes no search data before the parameters it plays with
  have cloned the experts: replay then holds no stale items."""
  import signal
  import threading
  from agents.variable_client import publish
  from launch.training import run_actor
  pretrain = 5
  config = dataclasses.replace(CONFIG, algorithm="alphazero", settings={
      "batch_size": 2, "pretrain_steps": pretrain, "simulations": 2})
  builder = config.builder()
  server = reverb.Server(builder.make_replay_tables())
  client = reverb.Client(f"localhost:{server.port}")
  params = builder.init_params(builder.make_networks())
  publish(client, params, 0)
  size_while_cloning = []

  def cloned():
    size_while_cloning.append(client.server_info()["trajectories"].current_size)
    publish(client, params, pretrain)

  timer = threading.Timer(4.0, cloned)
  handler = signal.getsignal(signal.SIGTERM)
  try:
    timer.start()
    run_actor(config, str(tmp_path), f"localhost:{server.port}", 0, episodes=1)
    written = client.server_info()["trajectories"].current_size
  finally:
    timer.cancel()
    signal.signal(signal.SIGTERM, handler)
    server.stop()
  assert size_while_cloning == [0] and written > 0
  episodes = _rows(tmp_path / "logs" / "actor_0.csv")
  assert [int(float(r["version"])) for r in episodes] == [pretrain]


def test_evaluator_logs_heldout_and_train_ratios_to_the_best_expert(tmp_path):
  """One evaluation round over Reverb: the greedy policy's step time over the best expert's,
  per held-out model and as means over the held-out and the train models, and at a tight
  budget. It plays the parameter average (the run keeps one), not the latest parameters."""
  import signal
  from agents.search.expert import best_expert, evaluate_experts
  import jax
  from agents.variable_client import AVERAGE_TABLE, publish
  from environments import PartitioningEnv
  from environments.tasks import data_parallel_peak
  from launch.training import run_evaluator
  config = dataclasses.replace(CONFIG, models=("gnn:mini",), eval_every_s=0.0,
                               budget_fractions=(None, 0.5))
  builder = config.builder()
  server = reverb.Server(builder.make_replay_tables())
  networks = builder.make_networks()
  params = builder.init_params(networks)
  client = reverb.Client(f"localhost:{server.port}")
  publish(client, jax.tree_util.tree_map(lambda x: x + 1, params), 3)
  publish(client, params, 4, AVERAGE_TABLE)
  handler = signal.getsignal(signal.SIGTERM)
  try:
    run_evaluator(config, str(tmp_path), f"localhost:{server.port}", rounds=1)
  finally:
    signal.signal(signal.SIGTERM, handler)
    server.stop()
  row, = _rows(tmp_path / "logs" / "evaluator.csv")
  assert int(float(row["version"])) == 4
  assert float(row["heldout_cost_ratio"]) == float(row["ratio_mlp"])
  from agents.decoding import play_best_prefix
  from agents.ppo.networks import make_policy
  policy = make_policy(networks, evaluation=True)

  def greedy(task):
    """(step time / best expert's, fits) of a greedy episode of the average's parameters as
    `propose` decodes it (`play_best_prefix`), in a fresh environment."""
    env = PartitioningEnv(task, config=config.env_config())
    env.reset()
    play_best_prefix(env, lambda obs: int(policy(params, jax.random.PRNGKey(0), obs)[0]))
    expert = best_expert(evaluate_experts(env.restart_clone()))
    return env.cost.step_time_s / expert.cost.step_time_s, env.fits

  train, = config.train_eval_tasks()
  assert train.model == "gnn:mini" and train.mesh == config.eval_mesh
  train_ratio = greedy(train)[0]
  assert np.isclose(float(row["train_cost_ratio"]), train_ratio)
  assert np.isclose(float(row["train_median_cost_ratio"]), train_ratio)
  assert float(row["train_within_10pct"]) == float(train_ratio <= 1.1)
  tight, = config.heldout_tasks(tight=True)
  full, = config.heldout_tasks()
  assert tight.model == full.model and tight.memory_budget < data_parallel_peak(full)
  ratio, fits = greedy(tight)
  assert np.isclose(float(row["heldout_tight_cost_ratio"]), ratio)
  assert float(row["heldout_tight_fits"]) == float(fits)
  assert float(row["heldout_tight_within_10pct"]) == float(fits and ratio <= 1.1)


def test_propose_is_deterministic(trained, capsys, tmp_path):
  from tests.launch.test_determinism import without_wall_clock
  run_dir = trained[0]
  outs = []
  for k, search in ((0, "greedy"), (1, "greedy"), (2, "mcts"), (3, "mcts")):
    path = tmp_path / f"{k}.json"
    code, _, err = run(capsys, "propose", "mlp:small", "--mesh", "batch=4,model=2", "--policy",
                       str(run_dir), "--search", search, "--budget", "8", "--json", str(path))
    assert code == 0, err
    outs.append(json.dumps(without_wall_clock(json.loads(path.read_text())), sort_keys=True))
  assert outs[0] == outs[1] and outs[2] == outs[3]

"""`--launcher ray` on a two-node Ray cluster started by the test on the loopback address, in
a network namespace of its own (`tests/launch/ray_cluster.py`): a training run whose learner
asks for a GPU lands on the node that has one, survives an actor process killed by its pid,
an actor's Ray worker killed under it, the learner killed (it resumes from its checkpoint)
and the Reverb server killed (the run goes on with a new one), stops on SIGTERM, and leaves
a checkpoint that `propose` loads. `evaluate --launcher ray`
gives the results of a local evaluation."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.launch.test_faults import EVERY, _checkpoint_steps, _pid, _role_pids, _steps, _wait
from tests.launch.test_train import CONFIG, _processes_mentioning

pytestmark = pytest.mark.slow   # a Ray cluster and training runs

HELPER = os.path.join(os.path.dirname(__file__), "ray_cluster.py")


def _in_own_network(command: list[str], out, err) -> subprocess.Popen:
  """Runs `command` with a fresh Ray cluster, in a new network namespace (only loopback)."""
  assert shutil.which("unshare") and shutil.which("ip"), "needs util-linux and iproute2"
  script = "ip link set lo up && exec \"$0\" \"$@\""
  return subprocess.Popen(["unshare", "--net", "--map-root-user", "sh", "-c", script,
                           sys.executable, HELPER, "--", *command],
                          env=dict(os.environ, PYTHONPATH=os.getcwd()), stdout=out, stderr=err,
                          text=True)


def _shardzero(*args) -> list[str]:
  return [sys.executable, "-m", "launch.cli", *args]


def _parent(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    return int(re.search(r"^PPid:\s+(\d+)", f.read(), re.M).group(1))


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return "\nState:\tZ" not in f.read()
  except OSError:
    return False


def _learner_log(run_dir) -> str:
  return (run_dir / "logs" / "learner.log").read_text()


def _learner_updates(run_dir) -> int:
  steps = _steps(run_dir)
  return steps[-1] if steps else 0


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
  """One run over Ray: an actor process killed, another actor's Ray worker killed, the
  learner killed; then SIGTERM to the launcher."""
  root = tmp_path_factory.mktemp("ray")
  run_dir = root / "run"
  dataclasses.replace(CONFIG, steps=100000, checkpoint_every=EVERY, actors=2).save(str(run_dir))
  out_path, err_path = root / "out.txt", root / "err.txt"
  record = {}
  with open(out_path, "w") as out, open(err_path, "w") as err:
    launcher = _in_own_network(_shardzero(
        "train", "--run-dir", str(run_dir), "--resume", "--no-evaluator", "--launcher", "ray",
        "--address", "{address}", "--learner-resources", "GPU=1", "--actor-cpus", "1"),
        out, err)
    try:
      _wait(lambda: _learner_updates(run_dir) >= 3, "the first updates")
      # One actor can feed the first updates while the other is still starting (a loaded
      # machine): wait for both processes.
      _wait(lambda: len(_role_pids(run_dir, "actor")) >= 2, "both actors")
      actors = sorted(_role_pids(run_dir, "actor"))
      record["actor_pids"] = actors
      os.kill(actors[0], signal.SIGKILL)                 # the role's own process
      _wait(lambda: err_path.read_text().count("starting it again") >= 1, "a restart")
      os.kill(_parent(actors[1]), signal.SIGKILL)        # the Ray worker hosting the role
      _wait(lambda: err_path.read_text().count("starting it again") >= 2, "a second restart")
      _wait(lambda: not _running(actors[1]), "the role of the lost worker to end", 60)
      before = _learner_updates(run_dir)
      _wait(lambda: _learner_updates(run_dir) >= before + 3, "updates after the restarts")
      record["learner_pid"] = _pid(run_dir, "learner")
      record["log_at_learner_kill"] = len(_learner_log(run_dir))
      os.kill(record["learner_pid"], signal.SIGKILL)
      record["logged_when_killed"] = _learner_updates(run_dir)
      _wait(lambda: err_path.read_text().count("starting it again") >= 3, "the learner restart")
      _wait(lambda: "resumed at update" in _learner_log(run_dir)[record["log_at_learner_kill"]:]
            or _learner_updates(run_dir) < record["logged_when_killed"]
            or _learner_updates(run_dir) > record["logged_when_killed"] + 3,
            "the resumed learner")
      resumed = _learner_updates(run_dir)
      _wait(lambda: _learner_updates(run_dir) >= resumed + 3, "updates after the resume")
      record["log_at_replay_kill"] = len(_learner_log(run_dir))
      os.kill(_pid(run_dir, "replay"), signal.SIGKILL)
      _wait(lambda: "starting the run again on a new server" in err_path.read_text(),
            "the run on a new Reverb server")
      record["checkpoint_at_new_server"] = _checkpoint_steps(run_dir)
      _wait(lambda: _learner_updates(run_dir) >= record["checkpoint_at_new_server"] + 3,
            "updates from the new Reverb server")
      record["pids_before_stop"] = _processes_mentioning(str(run_dir))
    finally:
      launcher.send_signal(signal.SIGTERM)
      record["code"] = launcher.wait(timeout=180)
  record["out"], record["err"] = out_path.read_text(), err_path.read_text()
  record["left"] = _processes_mentioning(str(run_dir))
  return run_dir, record


def test_the_cluster_is_reachable_on_loopback_only(ray_run):
  _, record = ray_run
  assert "interfaces: lo\n" in record["out"]


def test_the_learner_is_placed_on_the_node_with_the_gpu(ray_run):
  _, record = ray_run
  gpu = re.search(r"cluster: \S+ head (\w+) gpu (\w+)", record["out"]).group(2)
  placed = re.findall(r"ray: learner runs as pid \d+ on node (\w+)", record["out"])
  assert placed and all(gpu.startswith(node) for node in placed)


def test_a_killed_actor_process_and_a_lost_ray_worker_are_started_again(ray_run):
  run_dir, record = ray_run
  err = record["err"]
  assert re.search(r"the actor \d process was killed by SIGKILL; starting it again \(1 of 3\)",
                   err)
  assert re.search(r"the actor \d process was lost with its Ray worker or node \(.+\); "
                   r"starting it again \(1 of 3\)", err)
  for i in (0, 1):
    log = (run_dir / "logs" / f"actor_{i}.log").read_text()
    assert "started again" in log
    assert len(re.findall(rf"ray: actor {i} runs as pid", record["out"])) >= 2


def test_a_killed_learner_resumes_from_its_checkpoint(ray_run):
  run_dir, record = ray_run
  assert "the learner process was killed by SIGKILL; starting it again (1 of 3)" in record["err"]
  # What the learner printed after it was killed and before the Reverb server was (whose
  # replacement starts the learner again too, from a later checkpoint).
  log = _learner_log(run_dir)[record["log_at_learner_kill"]:record["log_at_replay_kill"]]
  match = re.search(r"resumed at update (\d+)", log)
  if match:          # updates past the checkpoint were lost, at most the interval
    assert 0 <= record["logged_when_killed"] - int(match.group(1)) <= EVERY
  steps = _steps(run_dir)
  assert steps == list(range(1, len(steps) + 1))        # each update logged once


def test_a_lost_reverb_server_is_replaced_and_the_run_goes_on(ray_run):
  run_dir, record = ray_run
  assert ("the replay process was killed by SIGKILL, and the Reverb server's contents with "
          "it; starting the run again on a new server" in record["err"])
  assert len(re.findall(r"ray: replay runs as pid", record["out"])) == 2
  assert _steps(run_dir)[-1] >= record["checkpoint_at_new_server"] + 3


def test_sigterm_stops_every_role_on_every_node_and_keeps_the_checkpoint(ray_run):
  run_dir, record = ray_run
  assert record["code"] == 130, record["err"][-3000:]
  assert f"continue with: shardzero train --run-dir {run_dir} --resume" in record["err"]
  assert len(record["pids_before_stop"]) >= 4 and record["left"] == []
  assert _checkpoint_steps(run_dir) == _steps(run_dir)[-1]


def test_propose_loads_the_checkpoint_of_the_ray_run(ray_run):
  run_dir, _ = ray_run
  out = subprocess.run(_shardzero("propose", "mlp:mini", "--mesh", "batch=4,model=2",
                                  "--policy", str(run_dir), "--json", "-"),
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout)["cost"]["step_time_s"] > 0


def test_evaluate_over_ray_gives_the_local_results(tmp_path):
  models, meshes = "mlp:mini", "batch=8;batch=4,model=2"
  common = ["evaluate", "--models", models, "--meshes", meshes, "--agents", "expert,greedy"]
  with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
    over_ray = _in_own_network(_shardzero(
        *common, "--launcher", "ray", "--address", "{address}", "--store",
        str(tmp_path / "ray.jsonl"), "--json", str(tmp_path / "ray.json")), out, err)
    assert over_ray.wait(timeout=300) == 0, (tmp_path / "err.txt").read_text()[-3000:]
  local = subprocess.run(_shardzero(*common, "--store", str(tmp_path / "local.jsonl"),
                                    "--json", "-"), capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
  assert local.returncode == 0, local.stderr[-2000:]

  def results(data):
    return {(r["agent"], r["task"]): (r["step_time_s"], r["schedule"]) for r in data["results"]}
  ray_results = results(json.loads((tmp_path / "ray.json").read_text()))
  assert len(ray_results) == 4
  assert ray_results == results(json.loads(local.stdout))


def test_a_run_asking_for_more_than_the_cluster_has_is_one_line(tmp_path):
  with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
    code = _in_own_network(_shardzero(
        "train", "--run-dir", str(tmp_path / "run"), "--launcher", "ray", "--address",
        "{address}", "--actors", "40"), out, err).wait(timeout=300)
  lines = [l for l in (tmp_path / "err.txt").read_text().splitlines() if "error:" in l]
  assert code == 2 and len(lines) == 1
  assert "the run asks Ray for more than its cluster has free: CPU=43 (free 6" in lines[0]
  assert not (tmp_path / "run" / "config.json").exists()     # nothing to --resume

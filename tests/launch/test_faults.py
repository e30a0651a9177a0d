"""`kill -9` of an actor, the learner and the Reverb server during a local run: the actor is
started again and the run goes on; after the learner or the server, the launcher stops every
process and `--resume` continues with at most `checkpoint_every` updates lost and logs that
have neither duplicated nor missing rows."""

import csv
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from learners import checkpointing
from tests.launch.test_train import CONFIG, _processes_mentioning

pytestmark = pytest.mark.slow   # training runs with processes killed

EVERY = 2          # checkpoint interval: the updates a killed learner may lose
FINAL = 40         # the update the last, uninterrupted part of the run reaches


def _rows(path) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def _steps(run_dir) -> list[int]:
  return [int(float(r["steps"])) for r in _rows(run_dir / "logs" / "learner.csv")]


def _launch(run_dir, *extra):
  return subprocess.Popen(
      [sys.executable, "-m", "launch.cli", "train", "--run-dir", str(run_dir), "--resume",
       "--no-evaluator", *extra], env=dict(os.environ, PYTHONPATH=os.getcwd()),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(condition, what: str, timeout_s: float = 300.0) -> None:
  deadline = time.time() + timeout_s
  while not condition():
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.25)


def _role_pids(run_dir, role: str) -> list[int]:
  """The processes of `run_dir` running `role` (`--role ROLE` on their command line)."""
  pids = []
  for pid in _processes_mentioning(str(run_dir)):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    except OSError:
      continue
    if "--role" in argv and argv[argv.index("--role") + 1] == role:
      pids.append(pid)
  return pids


def _pid(run_dir, role: str) -> int:
  pids = _role_pids(run_dir, role)
  assert pids, f"no {role} process of {run_dir}"
  return pids[0]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
  """One run through three faults: an actor killed (started again, the run goes on), then
  the learner killed, resumed, the Reverb server killed, resumed to update FINAL."""
  run_dir = tmp_path_factory.mktemp("faults")
  dataclasses.replace(CONFIG, steps=100000, checkpoint_every=EVERY).save(str(run_dir))
  record = {}

  launcher = _launch(run_dir)
  _wait(lambda: len(_steps(run_dir)) >= 3, "the first updates")
  os.kill(_pid(run_dir, "actor"), signal.SIGKILL)
  actor_log = run_dir / "logs" / "actor_0.log"
  _wait(lambda: "started again" in actor_log.read_text(), "the actor's restart")
  after_restart = len(_steps(run_dir))
  _wait(lambda: len(_steps(run_dir)) >= after_restart + 3, "updates after the restart")
  record["before_learner_kill"] = _steps(run_dir)[-1]
  os.kill(_pid(run_dir, "learner"), signal.SIGKILL)
  record["learner_killed"] = launcher.communicate(timeout=120) + (launcher.returncode,)
  record["logged_when_killed"] = _steps(run_dir)[-1]
  record["checkpoint_after_learner_kill"] = _checkpoint_steps(run_dir)
  record["left_after_learner_kill"] = _processes_mentioning(str(run_dir))

  launcher = _launch(run_dir)
  start = record["checkpoint_after_learner_kill"]
  _wait(lambda: _steps(run_dir)[-1] >= start + 3, "updates after the resume")
  os.kill(_pid(run_dir, "replay"), signal.SIGKILL)
  record["replay_killed"] = launcher.communicate(timeout=120) + (launcher.returncode,)
  record["logged_when_replay_killed"] = _steps(run_dir)[-1]
  record["checkpoint_after_replay_kill"] = _checkpoint_steps(run_dir)
  record["left_after_replay_kill"] = _processes_mentioning(str(run_dir))

  launcher = _launch(run_dir, "--steps", str(FINAL))
  record["finished"] = launcher.communicate(timeout=400) + (launcher.returncode,)
  return run_dir, record


def _checkpoint_steps(run_dir) -> int:
  return int(checkpointing.load(str(run_dir))["learner"]["counts"]["steps"])


def test_a_killed_actor_is_started_again_and_the_run_goes_on(faults):
  run_dir, record = faults
  _, err, _ = record["learner_killed"]
  assert "the actor 0 process was killed by SIGKILL; starting it again (1 of 3)" in err
  counts = [int(float(r["episodes"])) for r in _rows(run_dir / "logs" / "actor_0.csv")]
  assert counts == list(range(1, len(counts) + 1))   # the restarted actor kept counting


def test_a_killed_learner_stops_the_run_and_loses_at_most_the_checkpoint_interval(faults):
  run_dir, record = faults
  _, err, code = record["learner_killed"]
  assert code == 1
  assert "the learner process was killed by SIGKILL; stopped the others" in err
  assert f"continue with: shardzero train --run-dir {run_dir} --resume" in err
  assert record["left_after_learner_kill"] == []
  lost = record["logged_when_killed"] - record["checkpoint_after_learner_kill"]
  assert 0 <= lost <= EVERY


def test_a_killed_replay_server_stops_the_run_and_the_learner_checkpoints(faults):
  run_dir, record = faults
  _, err, code = record["replay_killed"]
  assert code == 1 and "the replay process was killed by SIGKILL" in err
  # The learner either saw the server go (one line saying so) or was stopped first.
  assert "Traceback" not in (run_dir / "logs" / "learner.log").read_text()
  assert record["left_after_replay_kill"] == []
  # A learner blocked in Reverb's sample past the SIGTERM grace ends without its last save
  # (CI saw update 9 logged, 8 kept): the bound is the checkpoint interval, as for a kill.
  kept = record["checkpoint_after_replay_kill"]
  assert kept > record["checkpoint_after_learner_kill"]
  assert 0 <= record["logged_when_replay_killed"] - kept <= EVERY


def test_after_the_faults_the_run_finishes_and_the_logs_have_each_update_once(faults):
  run_dir, record = faults
  out, err, code = record["finished"]
  assert code == 0, err[-2000:]
  assert _steps(run_dir) == list(range(1, FINAL + 1))
  assert _checkpoint_steps(run_dir) == FINAL
  assert not [f for f in os.listdir(run_dir) if ".tmp." in f]

"""Training through faults: the `make demo` recipe run once without interruption and once with
`kill -9` of an actor, of the learner and of the Reverb server at set fractions of the run,
each fault followed by what a user does (nothing for an actor, which the launcher starts
again; `--resume` for the others). Reports the updates each fault lost, whether the logs hold
every update exactly once and every actor episode in order, the wall time, and the greedy
policy's step time over the best expert's on the held-out models for both runs (the same
seed: the runs differ by the faults and by the timing of the actor processes). Prints a table
and writes benchmarks/results/fault_recovery.json.

  python benchmarks/fault_recovery.py [--steps 240] [--out runs/faults]
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.reporting import print_table, write_results  # noqa: E402

DEMO = ["--algorithm", "alphazero", "--actors", "2", "--set", "pretrain_steps=200",
        "--set", "pretrain_learning_rate=1e-2", "--set", "learning_rate=3e-3",
        "--set", "demonstrations=0.25", "--set", "ema_decay=0.9", "--no-evaluator"]
FAULTS = (("actor", 0.3), ("learner", 0.6), ("replay", 0.9))   # role, share of the run


def _learner_steps(run_dir: str) -> list[int]:
  path = os.path.join(run_dir, "logs", "learner.csv")
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return [int(float(r["steps"])) for r in csv.DictReader(f) if r.get("steps")]


def _role_pid(run_dir: str, role: str) -> int | None:
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    except (OSError, ValueError):
      continue
    if run_dir in argv and "--role" in argv and argv[argv.index("--role") + 1] == role:
      return int(entry)
  return None


def _train(run_dir: str, steps: int, resume: bool) -> subprocess.Popen:
  """The launcher, its output appended to RUN/launcher.log."""
  argv = [sys.executable, "-m", "launch.cli", "train", "--run-dir", run_dir,
          "--steps", str(steps), *DEMO] + (["--resume"] if resume else [])
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "launcher.log"), "a") as log:
    return subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=log, stderr=subprocess.STDOUT)


def _tail(run_dir: str) -> str:
  with open(os.path.join(run_dir, "launcher.log"), errors="replace") as f:
    return f.read()[-2000:]


def _checkpoint_steps(run_dir: str) -> int:
  from learners import checkpointing
  return int(checkpointing.load(run_dir)["learner"]["counts"]["steps"])


def run_with_faults(run_dir: str, steps: int) -> list[dict]:
  """The demo run with each of FAULTS; returns one record per fault."""
  records = []
  proc = _train(run_dir, steps, resume=False)
  for role, share in FAULTS:
    at = int(share * steps)
    while not _learner_steps(run_dir) or _learner_steps(run_dir)[-1] < at:
      if proc.poll() is not None:
        raise RuntimeError(f"the run stopped before update {at}: {_tail(run_dir)}")
      time.sleep(0.5)
    pid = _role_pid(run_dir, role)
    logged = _learner_steps(run_dir)[-1]
    os.kill(pid, signal.SIGKILL)
    print(f"killed the {role} (pid {pid}) at update {logged}", flush=True)
    record = {"fault": f"kill -9 {role}", "at_update": logged}
    if role == "actor":          # the launcher starts it again; the run goes on
      logs = glob.glob(os.path.join(run_dir, "logs", "actor_*.log"))
      deadline = time.time() + 60
      while not any("started again" in Path(p).read_text() for p in logs):
        if time.time() > deadline or proc.poll() is not None:
          raise RuntimeError("the killed actor was not started again")
        time.sleep(0.5)
      record["lost_updates"] = 0
    else:
      proc.wait(timeout=300)
      record["launcher_exit"] = proc.returncode
      record["lost_updates"] = _learner_steps(run_dir)[-1] - _checkpoint_steps(run_dir)
      proc = _train(run_dir, steps, resume=True)
    records.append(record)
  proc.wait()
  if proc.returncode != 0:
    raise RuntimeError(f"the last part of the run failed: {_tail(run_dir)}")
  return records


def logs_intact(run_dir: str, steps: int) -> dict:
  episodes_in_order = True
  for path in glob.glob(os.path.join(run_dir, "logs", "actor_*.csv")):
    with open(path, newline="") as f:
      counts = [int(float(r["episodes"])) for r in csv.DictReader(f)]
    episodes_in_order &= counts == list(range(1, len(counts) + 1))
  return {"updates_logged_once": _learner_steps(run_dir) == list(range(1, steps + 1)),
          "episodes_in_order": episodes_in_order, "checkpoint": _checkpoint_steps(run_dir)}


def heldout_ratios(run_dir: str) -> dict:
  """The greedy policy's step time over the best expert's, per held-out model."""
  from agents.search.expert import best_expert, evaluate_experts
  from agents.decoding import play_policy
  from learners.policies import load_policy
  from environments import PartitioningEnv
  from learners.run_config import RunConfig
  config = RunConfig.load(run_dir)
  policy = load_policy(run_dir)
  out = {}
  for task in config.heldout_tasks():
    env = PartitioningEnv(task, config=config.env_config())
    env.reset()
    expert = best_expert(evaluate_experts(env.restart_clone())).cost.step_time_s
    play_policy(env, policy, "greedy")
    out[task.model] = env.cost.step_time_s / expert
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=240)
  parser.add_argument("--out", default="runs/faults")
  parser.add_argument("--json", default=str(ROOT / "benchmarks/results/fault_recovery.json"))
  args = parser.parse_args(argv)
  shutil.rmtree(args.out, ignore_errors=True)
  clean, faulty = os.path.abspath(f"{args.out}/clean"), os.path.abspath(f"{args.out}/faults")
  start = time.time()
  proc = _train(clean, args.steps, resume=False)
  proc.wait()
  if proc.returncode != 0:
    raise RuntimeError(f"the uninterrupted run failed: {_tail(clean)}")
  clean_s = time.time() - start
  print(f"uninterrupted run: {clean_s:.0f} s", flush=True)
  start = time.time()
  faults = run_with_faults(faulty, args.steps)
  faulty_s = time.time() - start
  print(f"run with faults: {faulty_s:.0f} s", flush=True)
  ratios = {"uninterrupted": heldout_ratios(clean), "with faults": heldout_ratios(faulty)}
  models = sorted(ratios["uninterrupted"])
  print_table(["run", "seconds", *[m.split(":")[0] for m in models], "mean"],
              [[name, f"{s:.0f}", *[f"{ratios[name][m]:.3f}" for m in models],
                f"{sum(ratios[name].values()) / len(models):.3f}"]
               for name, s in (("uninterrupted", clean_s), ("with faults", faulty_s))], 14)
  print_table(["fault", "at update", "lost updates"],
              [[f["fault"], f["at_update"], f["lost_updates"]] for f in faults], 18)
  intact = {"uninterrupted": logs_intact(clean, args.steps),
            "with faults": logs_intact(faulty, args.steps)}
  print(intact)
  write_results(args.json, "fault_recovery", faults, steps=args.steps, ratios=ratios,
                seconds={"uninterrupted": clean_s, "with faults": faulty_s}, logs=intact)
  return 0


if __name__ == "__main__":
  sys.exit(main())

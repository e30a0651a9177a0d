"""Environment steps per second of a training run with 1, 2 and 4 actors, started by the local
launcher and by `--launcher ray` (Ray on this machine) in turn, on the same machine and
recipe (PPO on the train split at `mini`, no evaluator). For each run: the seconds from the
launcher's start to every actor's first episode, then the actors' steps over a --window
seconds window, and on the Ray path the memory of the Ray processes (GCS, raylet, the workers
that host the roles) and of each role host. Both launchers run the same role processes, so
the Ray path's cost is its start-up and its daemons. Prints a table and writes
benchmarks/results/ray_throughput.json.

  python benchmarks/ray_throughput.py [--actors 1,2,4] [--window 45] [--out runs/ray_bench]
"""

from __future__ import annotations

import argparse
import csv
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

RECIPE = ["--algorithm", "ppo", "--steps", "100000", "--no-evaluator"]


def _actor_steps(run_dir: str, actors: int) -> list[int] | None:
  """Each actor's environment steps so far, or None while one has not ended an episode."""
  out = []
  for i in range(actors):
    path = os.path.join(run_dir, "logs", f"actor_{i}.csv")
    if not os.path.exists(path):
      return None
    with open(path, newline="") as f:
      rows = [r for r in csv.DictReader(f) if r.get("steps")]
    if not rows:
      return None
    out.append(int(float(rows[-1]["steps"])))
  return out


def _rss_mib(pid: int) -> float:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return 0.0


def _ray_memory(run_dir: str) -> dict:
  """RSS of Ray's daemons and of the workers hosting the roles (the parents of the role
  processes), in MiB."""
  roles, hosts, daemons = [], set(), 0.0
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    except OSError:
      continue
    text = " ".join(argv)
    if run_dir in argv and "--role" in argv:
      roles.append(int(entry))
    elif "gcs_server" in text or "raylet" in text or "ray/_private" in text \
        or "dashboard" in text or "runtime_env" in text:
      daemons += _rss_mib(int(entry))
  for pid in roles:
    with open(f"/proc/{pid}/status") as f:
      hosts.add(int(next(l for l in f if l.startswith("PPid:")).split()[1]))
  host_mib = [_rss_mib(p) for p in hosts]
  return {"ray_daemons_mib": daemons, "role_hosts": len(hosts),
          "role_host_mib": sum(host_mib) / max(1, len(host_mib))}


def measure(launcher: str, actors: int, window_s: float, out: str) -> dict:
  run_dir = os.path.abspath(os.path.join(out, f"{launcher}_{actors}"))
  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  argv = [sys.executable, "-m", "launch.cli", "train", "--run-dir", run_dir, "--actors",
          str(actors), *RECIPE] + (["--launcher", "ray"]
                                   if launcher == "ray" else [])
  start = time.time()
  with open(os.path.join(run_dir, "..", f"{launcher}_{actors}.log"), "w") as log:
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=log, stderr=subprocess.STDOUT)
  try:
    while _actor_steps(run_dir, actors) is None:
      if proc.poll() is not None or time.time() - start > 600:
        raise RuntimeError(f"{launcher} with {actors} actor(s) did not start: see {log.name}")
      time.sleep(0.5)
    first = time.time() - start
    before, t0 = _actor_steps(run_dir, actors), time.time()
    time.sleep(window_s)
    after, t1 = _actor_steps(run_dir, actors), time.time()
    memory = _ray_memory(run_dir) if launcher == "ray" else {}
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=180)
  stopped = time.time() - start
  rate = (sum(after) - sum(before)) / (t1 - t0)
  print(f"{launcher:>5} {actors} actor(s): first episodes after {first:.1f} s, "
        f"{rate:.1f} steps/s", flush=True)
  return {"launcher": launcher, "actors": actors, "first_episode_s": first,
          "steps_per_s": rate, "run_s": stopped, **memory}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--actors", default="1,2,4")
  parser.add_argument("--window", type=float, default=45.0)
  parser.add_argument("--out", default="runs/ray_bench")
  parser.add_argument("--json", default=str(ROOT / "benchmarks/results/ray_throughput.json"))
  args = parser.parse_args(argv)
  counts = [int(a) for a in args.actors.split(",")]
  rows = []
  for actors in counts:
    for launcher in ("local", "ray"):
      rows.append(measure(launcher, actors, args.window, args.out))
  table = []
  for actors in counts:
    local, ray = (next(r for r in rows if r["launcher"] == l and r["actors"] == actors)
                  for l in ("local", "ray"))
    table.append([actors, f"{local['steps_per_s']:.1f}", f"{ray['steps_per_s']:.1f}",
                  f"{ray['steps_per_s'] / local['steps_per_s']:.2f}",
                  f"{local['first_episode_s']:.0f}", f"{ray['first_episode_s']:.0f}",
                  f"{ray['ray_daemons_mib']:.0f}", f"{ray['role_host_mib']:.0f}"])
  print_table(["actors", "local st/s", "ray st/s", "ray/local", "local start", "ray start",
               "ray MiB", "host MiB"], table, 12)
  write_results(args.json, "ray_throughput", rows, window_s=args.window,
                cpus=os.cpu_count())
  return 0


if __name__ == "__main__":
  sys.exit(main())

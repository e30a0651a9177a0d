"""Instructions per partitioning-environment step, counted by valgrind's callgrind.

Wall-clock steps/s on a shared VM moves by 30-40% from one minute to the next, more than most
changes to the step are worth; the instructions a step executes do not (two runs of the same
code agree to 0.01%). So compare two versions of the code by this count: run it in each
checkout and compare `instructions/step`. It counts the interpreter, numpy and the garbage
collector, not cache misses, so it is a proxy for time, not time.

The task is set up with instrumentation off (valgrind runs it a few times slower), then the
process switches callgrind on for `--steps` random steps of new states (as
bench_environment.py takes them) and off again. Needs `valgrind` (apt install valgrind); with
200 steps of the 12-layer GPT it takes about two minutes. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps(model: str, mesh: str, steps: int, fold: bool) -> None:
  """The child, under valgrind: set up, then count `steps` steps."""
  sys.path.insert(0, str(ROOT))
  import numpy as np
  from environments import PartitioningEnv, Task
  from launch.runtime import relax_gc
  relax_gc()
  env = PartitioningEnv(Task(model, mesh), seed=0, fold=fold)
  rng = np.random.default_rng(0)

  def run(n):
    taken = 0
    while taken < n:
      ts = env.reset()
      while not ts.last() and taken < n:
        ts = env.step(int(rng.choice(env.legal_actions())))
        taken += 1

  run(20)   # first-step caches, as a search would have them
  toggle = lambda on: subprocess.run(["callgrind_control", "-i", on, str(os.getpid())],
                                     check=True, capture_output=True)
  toggle("on")
  run(steps)
  toggle("off")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="gpt:125m")
  parser.add_argument("--mesh", default="batch=4,model=8")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--no-fold", action="store_true", help="play the whole program")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    _steps(args.model, args.mesh, args.steps, not args.no_fold)
    return 0
  if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
    parser.error("needs valgrind and callgrind_control on PATH (apt install valgrind)")
  env = dict(os.environ, PYTHONHASHSEED="0", JAX_PLATFORMS="cpu")
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           sys.executable, __file__, "--child", "--model", args.model, "--mesh", args.mesh,
           "--steps", str(args.steps)] + (["--no-fold"] if args.no_fold else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
      sys.stderr.write(done.stderr[-4000:])
      return done.returncode
    total = re.search(r"^totals: (\d+)", out.read_text(), re.M)
  if total is None:
    sys.exit("callgrind wrote no totals")
  n = int(total.group(1))
  print(f"{args.model} on {args.mesh}{' unfolded' if args.no_fold else ''}: {args.steps} steps, "
        f"{n:,} instructions, {n / args.steps / 1e6:.2f} M instructions/step")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""`shardzero plot RUN_DIR`: the learning curves of a training run, as a PNG."""

from __future__ import annotations

import argparse
import glob
import os

HELP = "draw the learning curves of a training run to a PNG"


def add_parser(sub) -> None:
  p = sub.add_parser("plot", help=HELP, description=HELP + ": learner loss, actor episode "
                     "returns, and the held-out cost ratio (policy step time over the best "
                     "expert's) against learner updates.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir")
  p.add_argument("--out", help="PNG path; default RUN_DIR/curves.png")
  p.set_defaults(run=run)


def _smooth(values, window: int = 10):
  import numpy as np
  values = np.asarray(values, float)
  if len(values) < window:
    return values
  kernel = np.ones(window) / window
  return np.convolve(values, kernel, mode="valid")


def plot(run_dir: str, out: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from launch.progress import read_csv
  from partitioner.errors import ShardzeroError
  logs = os.path.join(run_dir, "logs")
  learner = read_csv(os.path.join(logs, "learner.csv"))
  episodes = sorted((r for p in glob.glob(os.path.join(logs, "actor_*.csv")) for r in read_csv(p)),
                    key=lambda r: float(r["time"]))
  evaluator = read_csv(os.path.join(logs, "evaluator.csv"))
  if not (learner or episodes or evaluator):
    raise ShardzeroError(f"{run_dir} has no training logs (logs/*.csv)")
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  ax = axes[0]
  if learner:
    steps = [float(r["steps"]) for r in learner]
    ax.plot(steps, [float(r["loss"]) for r in learner], alpha=0.4, label="loss")
    ax.plot(steps[len(steps) - len(_smooth(steps)):], _smooth([float(r["loss"]) for r in learner]),
            label="loss (smoothed)")
  ax.set(title="learner", xlabel="updates", ylabel="loss")
  if learner:
    ax.legend()
  ax = axes[1]
  if episodes:
    returns = [float(r["episode_return"]) for r in episodes]
    ax.plot(returns, ".", alpha=0.3, label="episode")
    smooth = _smooth(returns, 20)
    ax.plot(range(len(returns) - len(smooth), len(returns)), smooth, label="mean of 20")
  ax.set(title="actors", xlabel="episodes", ylabel="return")
  if episodes:
    ax.legend()
  ax = axes[2]
  if evaluator:
    versions = [float(r["version"]) for r in evaluator]
    ax.plot(versions, [float(r["heldout_cost_ratio"]) for r in evaluator], "o-",
            label="mean over held-out models")
    if "heldout_tight_cost_ratio" in evaluator[0]:
      ax.plot(versions, [float(r["heldout_tight_cost_ratio"]) for r in evaluator], "^-",
              label="mean over held-out models, tight budget")
    if "train_cost_ratio" in evaluator[0]:
      ax.plot(versions, [float(r["train_cost_ratio"]) for r in evaluator], "s--",
              label="mean over train models")
    for key in evaluator[0]:
      if key.startswith("ratio_"):
        ax.plot(versions, [float(r[key]) for r in evaluator], alpha=0.4, label=key[6:])
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.axhline(1.1, color="gray", ls=":", lw=1)
  ax.set(title="greedy policy step time / best expert", xlabel="updates (parameter version)",
         ylabel="cost ratio")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.suptitle(run_dir)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def run(args) -> int:
  out = args.out or os.path.join(args.run_dir, "curves.png")
  print(plot(args.run_dir, out))
  return 0

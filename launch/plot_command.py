"""`shardzero plot RUN_DIR [RUN_DIR ...]`: the learning curves of a training run as a PNG, or
the evaluator's curves of several runs on common axes (seeds, settings) to compare them."""

from __future__ import annotations

import argparse
import glob
import os

HELP = "draw the learning curves of a training run (or compare several) to a PNG"


def add_parser(sub) -> None:
  p = sub.add_parser("plot", help=HELP, description=HELP + ". One run: learner loss, actor "
                     "episode returns, and the held-out cost ratio (policy step time over the "
                     "best expert's) against learner updates. Several runs: the held-out mean "
                     "(full and tight budget) and the train models' median of each run on "
                     "common axes, e.g. `shardzero plot runs/a runs/b --out seeds.png`.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", nargs="+")
  p.add_argument("--out", help="PNG path; default RUN_DIR/curves.png (one run) or "
                 "FIRST_RUN_DIR/compare.png (several)")
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
    if "train_median_cost_ratio" in evaluator[0]:
      ax.plot(versions, [float(r["train_median_cost_ratio"]) for r in evaluator], "s:",
              label="median over train models")
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


# Panel title, line style, and the evaluator columns it draws (the first a run logged; runs
# from before the train median was logged show the train mean).
_COMPARED = (("held-out mean", "-", ("heldout_cost_ratio",)),
             ("held-out mean, tight budget", "--", ("heldout_tight_cost_ratio",)),
             ("train models, median", ":", ("train_median_cost_ratio", "train_cost_ratio")))


def comparison(run_dirs):
  """The evaluator's curves of several runs as a figure: one panel per quantity, one line per
  run."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from launch.progress import read_csv
  from partitioner.errors import ShardzeroError
  curves = {}
  for run_dir in run_dirs:
    if not os.path.isdir(run_dir):
      raise ShardzeroError(f"no run directory {run_dir!r}")
    curves[run_dir] = read_csv(os.path.join(run_dir, "logs", "evaluator.csv"))
    if not curves[run_dir]:
      raise ShardzeroError(f"{run_dir} has no evaluator log (logs/evaluator.csv) to compare")
  fig, axes = plt.subplots(1, len(_COMPARED), figsize=(5 * len(_COMPARED), 4), sharey=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (title, style, keys) in zip(axes, _COMPARED):
    for i, (run_dir, rows) in enumerate(curves.items()):
      key = next((k for k in keys if k in rows[0]), None)
      if key is None:
        continue
      label = os.path.basename(os.path.normpath(run_dir)) + (" (mean)" if key != keys[0] else "")
      ax.plot([float(r["version"]) for r in rows], [float(r[key]) for r in rows], style,
              color=colors[i % len(colors)], label=label)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.axhline(1.1, color="gray", ls=":", lw=1)
    ax.set(title=title, xlabel="updates (parameter version)", ylabel="greedy step time / best "
           "expert")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.tight_layout()
  return fig


def compare(run_dirs, out: str) -> str:
  import matplotlib.pyplot as plt
  fig = comparison(run_dirs)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def run(args) -> int:
  if len(args.run_dir) == 1:
    print(plot(args.run_dir[0], args.out or os.path.join(args.run_dir[0], "curves.png")))
  else:
    print(compare(args.run_dir, args.out or os.path.join(args.run_dir[0], "compare.png")))
  return 0

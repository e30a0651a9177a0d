"""Progress of a training run, read from its CSV logs (so it works for any process layout)."""

from __future__ import annotations

import csv
import glob
import os
import time

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def read_csv(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return [row for row in csv.DictReader(f)]


def summary(run_dir: str, since: float) -> dict:
  """Learner updates, actor episodes/s since `since`, recent mean return, held-out ratio."""
  logs = os.path.join(run_dir, "logs")
  learner = read_csv(os.path.join(logs, "learner.csv"))
  episodes = [r for p in sorted(glob.glob(os.path.join(logs, "actor_*.csv"))) for r in read_csv(p)]
  recent = [r for r in episodes if float(r["time"]) >= since]
  evaluator = read_csv(os.path.join(logs, "evaluator.csv"))
  returns = [float(r["episode_return"]) for r in sorted(episodes, key=lambda r: float(r["time"]))]
  elapsed = max(time.time() - since, 1e-9)
  return {
      "steps": int(float(learner[-1]["steps"])) if learner else 0,
      "episodes": len(episodes),
      "episodes_per_s": len(recent) / elapsed,
      "mean_return": float(np.mean(returns[-20:])) if returns else float("nan"),
      "heldout_ratio": float(evaluator[-1]["heldout_cost_ratio"]) if evaluator else float("nan"),
  }


class TrainingProgress:
  """A rich progress bar over learner updates with the run's vital signs."""

  def __init__(self, run_dir: str, config):
    self._run_dir, self._total = run_dir, config.steps
    self._since = time.time()
    self._progress = Progress(
        TextColumn("[bold]updates"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    self._task = None

  def __enter__(self):
    self._progress.__enter__()
    self._task = self._progress.add_task("train", total=self._total, info="starting...")
    return self

  def __exit__(self, *exc):
    self.refresh()
    return self._progress.__exit__(*exc)

  def refresh(self) -> None:
    try:
      s = summary(self._run_dir, self._since)
    except (OSError, ValueError, KeyError):
      return            # a log being written; next time
    info = (f"episodes {s['episodes']} ({s['episodes_per_s']:.2f}/s) | return "
            f"{s['mean_return']:.3f} | held-out cost/expert {s['heldout_ratio']:.3f}")
    self._progress.update(self._task, completed=s["steps"], info=info)

"""Progress of long commands: a bar on a terminal, a plain line every few seconds otherwise
(a pipe or a CI log is never silent for minutes). A training run's progress is read from its
CSV logs, so it works for any process layout."""

from __future__ import annotations

import csv
import glob
import os
import sys
import threading
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


class Ticker:
  """A progress bar over `total` units with an info field, or, when stdout is not a terminal,
  a line `label: done/total (elapsed) info` every `every` seconds and at the end."""

  def __init__(self, label: str, total: int, every: float = 10.0, unit: str = ""):
    self._label, self._total, self._every, self._unit = label, total, every, unit
    self._tty = sys.stdout.isatty()
    self._start = self._last = time.time()
    self._completed, self._info = 0, ""
    self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(),
                         TextColumn("{task.completed}/{task.total}"),
                         TextColumn("{task.fields[info]}"), TimeElapsedColumn()) \
        if self._tty else None
    self._lock = threading.Lock()
    self._stop = threading.Event()

  def __enter__(self):
    if self._bar is not None:
      self._bar.__enter__()
      self._task = self._bar.add_task(self._label, total=self._total, info="starting...")
    else:     # a heartbeat, so that one long unit of work is not silence
      threading.Thread(target=self._beat, daemon=True).start()
    return self

  def __exit__(self, *exc):
    if self._bar is not None:
      return self._bar.__exit__(*exc)
    self._stop.set()
    self._line()
    return False

  def update(self, completed: int, info: str = "") -> None:
    self._completed, self._info = completed, info
    if self._bar is not None:
      self._bar.update(self._task, completed=completed, info=info)
    elif time.time() - self._last >= self._every:
      self._line()

  def _beat(self) -> None:
    while not self._stop.wait(self._every / 4):
      if time.time() - self._last >= self._every:
        self._line()

  def _line(self) -> None:
    with self._lock:
      self._last = time.time()
      elapsed = int(self._last - self._start)
      print(f"{self._label}: {self._completed}/{self._total}{self._unit} "
            f"({elapsed // 60}:{elapsed % 60:02d}) {self._info}".rstrip(), flush=True)


class TrainingProgress:
  """Progress over learner updates with the run's vital signs."""

  def __init__(self, run_dir: str, config):
    self._run_dir = run_dir
    self._since = time.time()
    self._ticker = Ticker("updates", config.steps)

  def __enter__(self):
    self._ticker.__enter__()
    return self

  def __exit__(self, *exc):
    self.refresh()
    return self._ticker.__exit__(*exc)

  def refresh(self) -> None:
    try:
      s = summary(self._run_dir, self._since)
    except (OSError, ValueError, KeyError):
      return            # a log being written; next time
    info = (f"episodes {s['episodes']} ({s['episodes_per_s']:.2f}/s) | return "
            f"{s['mean_return']:.3f} | held-out cost/expert {s['heldout_ratio']:.3f}")
    self._ticker.update(s["steps"], info)

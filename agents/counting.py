"""A hierarchical counter (Acme's `acme.utils.counting.Counter`): counts of steps, episodes,
learner updates; a child counter adds its counts, prefixed, to its parent's."""

from __future__ import annotations

import threading
from typing import Mapping, Optional


class Counter:
  """Thread-safe counts. `Counter(parent, prefix="actor")` increments `actor_steps` in the
  parent when its own `steps` grows."""

  def __init__(self, parent: Optional["Counter"] = None, prefix: str = "",
               return_only_prefixed: bool = False):
    self._parent = parent
    self._prefix = prefix
    self._return_only_prefixed = return_only_prefixed
    self._counts: dict[str, float] = {}
    self._lock = threading.Lock()

  def increment(self, **counts: float) -> dict[str, float]:
    """Adds to the named counts and returns all counts (the root's view)."""
    with self._lock:
      for key, value in counts.items():
        self._counts[key] = self._counts.get(key, 0) + value
    if self._parent is not None:
      prefixed = {self._prefixed(k): v for k, v in counts.items()}
      self._parent.increment(**prefixed)
    return self.get_counts()

  def get_counts(self) -> dict[str, float]:
    """Own counts, plus the parent's (all of them, or only this counter's prefixed ones)."""
    with self._lock:
      counts = dict(self._counts)
    if self._parent is not None:
      parent = self._parent.get_counts()
      if self._return_only_prefixed:
        parent = {k: v for k, v in parent.items() if k.startswith(f"{self._prefix}_")}
      counts = {**parent, **counts}
    return counts

  def save(self) -> Mapping[str, float]:
    with self._lock:
      return dict(self._counts)

  def restore(self, state: Mapping[str, float]) -> None:
    with self._lock:
      self._counts = dict(state)

  def _prefixed(self, key: str) -> str:
    return f"{self._prefix}_{key}" if self._prefix else key

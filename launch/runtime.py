"""Process-wide settings for the programs that step partitioning environments."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def relax_gc(threshold: int = YOUNG_THRESHOLD) -> None:
  """Collects young objects every `threshold` allocations instead of CPython's 700.

  A partitioning step allocates tens of thousands of small containers (shardings, memo keys,
  op plans) that the state cache keeps alive, so at the default a collection runs every few
  hundred op visits and rescans them: about a quarter of a step on a 12-layer GPT
  (benchmarks/bench_environment.py). Cycles are still collected, later."""
  young, middle, old = gc.get_threshold()
  gc.set_threshold(max(young, threshold), middle, old)

"""Process-wide settings for the programs that step partitioning environments."""

from __future__ import annotations

import contextlib
import gc

YOUNG_THRESHOLD = 200_000


def relax_gc(threshold: int = YOUNG_THRESHOLD) -> None:
  """Collects young objects every `threshold` allocations instead of CPython's 700.

  A step makes no reference cycles, but each state a task's cache keeps alive holds some
  20 000 references (shardings, origins, op plans), and every young collection rescans the
  states made since the last one. At CPython's default that was about a quarter of a step on
  a 12-layer GPT; at 10 000, 14.5% of it; at 200 000 it runs every few hundred steps
  and took 1-2% of 3000 (more in benchmarks/bench_environment.py's 1000-step window, whose
  first collections also scan what the set-up left). Cycles are still collected, later."""
  young, middle, old = gc.get_threshold()
  gc.set_threshold(max(young, threshold), middle, old)


@contextlib.contextmanager
def collector_paused():
  """No automatic collection inside the block: a policy's decision of a second or two.

  A process holding a few large programs (Megatron-LM's Table 1 rows, each traced whole, cut
  and pipelined) keeps a million objects or more; a full or middle collection then rescans
  them, 0.2-0.8 s each, a third of a guarded decision when one fell inside it. Little of what
  a decision makes is cyclic garbage; what is waits for the next collection after it."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()

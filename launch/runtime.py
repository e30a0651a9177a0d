"""Process-wide settings for the programs that step partitioning environments."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

YOUNG_THRESHOLD = 200_000
CACHE_ENV = "SHARDZERO_COMPILATION_CACHE"
CACHE_BYTES = 2**30


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


def compilation_cache() -> str | None:
  """Keeps XLA's slower compilations on disk for the next process: the policy network's, once
  per observation-size bucket (about 1 s each on 2 cores: 2 s of a 10 s `shardzero propose` on
  Megatron-LM's 39.1B, the second time), and the roles of a training run started again. In
  `$SHARDZERO_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/shardzero/xla` (`~/.cache`), at most
  1 GiB (least recently used first out); `off` turns it off, and JAX's own
  `JAX_COMPILATION_CACHE_DIR` is left to JAX; a directory it cannot write turns it off with one
  line. Compilations under 0.2 s are not kept. Returns the directory (None: off); takes effect
  where the process has compiled nothing yet."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  path = os.environ.get(CACHE_ENV) or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardzero", "xla")
  if path == "off":
    return None
  try:
    os.makedirs(path, exist_ok=True)
    writable = os.access(path, os.W_OK)
  except OSError:
    writable = False
  if not writable:   # JAX would warn at every compilation
    print(f"shardzero: compilation cache off: cannot write {path} (set {CACHE_ENV} to a "
          "directory, or to off)", file=sys.stderr)
    return None
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)
  return path

"""Caches are owned by objects with bounds: the least recently used entry goes first, a cached
None is kept (a task that does not fold is not traced again), and clearing empties them."""

import pytest

from environments.caching import LRU
from environments.partitioning_env import task_context
from environments.tasks import TaskCache, Task


def test_lru_drops_the_least_recently_used_and_keeps_none():
  cache = LRU(2)
  made = []
  make = lambda key, value: cache.get_or_make(key, lambda: made.append(key) or value)
  assert make("a", 1) == 1 and make("b", None) is None
  assert make("a", 9) == 1            # kept, and now the most recently used
  assert make("b", 9) is None         # a cached None is not made again
  make("c", 3)                        # evicts "a", the least recently used
  assert len(cache) == 2 and cache.get("a") is None and made == ["a", "b", "c"]
  cache.clear()
  assert len(cache) == 0
  with pytest.raises(ValueError, match="at least one"):
    LRU(0)


def test_a_task_cache_shares_programs_and_contexts_within_its_bounds():
  cache = TaskCache(programs=1, contexts=1)
  task = Task("mlp:mini", "batch=4,model=2")
  assert cache.program("mlp:mini") is cache.program("mlp:mini")
  context = task_context(task, cache=cache)
  assert task_context(task, cache=cache) is context
  tight = task_context(Task("mlp:mini", "batch=4,model=2", memory_budget=2**30), cache=cache)
  assert tight.states is context.states and tight.budget == 2**30     # budgets share states
  task_context(Task("mlp:mini", "batch=2,model=4"), cache=cache)      # evicts the first
  assert task_context(task, cache=cache) is not context
  cache.clear()
  assert len(cache.programs) == len(cache.contexts) == 0

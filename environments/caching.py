"""A bounded cache owned by whoever holds it: the `size` most recently used entries."""

from __future__ import annotations

import collections
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class LRU(Generic[V]):

  def __init__(self, size: int):
    if size < 1:
      raise ValueError(f"a cache holds at least one entry, got size {size}")
    self.size = size
    self._entries: collections.OrderedDict[Hashable, V] = collections.OrderedDict()

  def get(self, key: Hashable) -> V | None:
    """The entry of `key`, or None."""
    value = self._entries.get(key)
    if value is not None:
      self._entries.move_to_end(key)
    return value

  def put(self, key: Hashable, value: V) -> V:
    self._entries[key] = value
    self._entries.move_to_end(key)
    if len(self._entries) > self.size:
      self._entries.popitem(last=False)
    return value

  def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
    """The entry of `key`, made (and kept) if there is none; None is kept like any value."""
    if key in self._entries:
      self._entries.move_to_end(key)
      return self._entries[key]
    return self.put(key, make())

  def clear(self) -> None:
    self._entries.clear()

  def __len__(self) -> int:
    return len(self._entries)

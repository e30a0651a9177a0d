"""The states of one task: what is derived from each (`StateInfo`), the bounded cache of them
by action sequence, and the Zobrist hash that makes transpositions (the same partitioning
reached by other orders of actions) equal keys."""

from __future__ import annotations

import array
import random
from typing import NamedTuple, Sequence

import numpy as np

from environments.caching import LRU
from partitioner.partition import PartitionedProgram

_MASK64 = (1 << 64) - 1


class StateInfo(NamedTuple):
  """One partitioning state of a task, with what was derived from it."""
  pp: PartitionedProgram
  cost: object                     # CostReport
  mask: np.ndarray                 # legal actions (bool, padded)
  sharding: np.ndarray             # node sharding features
  problems: dict                   # action index -> why it is masked (filled on demand)
  key: int                         # equal for equal partitioning states (transpositions)
  layout: int                      # sum of the values' Zobrist terms, updated per step
  terms: array.array               # per value, its Zobrist term


class StateCache(LRU[StateInfo]):
  """States by the action sequence that reached them, the `size` most recently used kept."""

  def __init__(self, size: int = 256):
    super().__init__(size)


class ZobristHash:
  """A 64-bit hash of a state's layouts: the sum over values of a random term per (value, its
  layout id), so a step rehashes only the values it changed. The terms are random, not
  Python's hash: tuple hashes are nearly additive in their items, so a sum of them would
  cancel the value out and the same tile on two values of one shape would give equal keys.
  Seeded: the same task gives the same keys in every process."""

  def __init__(self, seed: int = 0):
    self._terms: dict[tuple[int, int], int] = {}
    self._random = random.Random(seed)

  def term(self, vid: int, layout_id: int) -> int:
    key = (vid, layout_id)
    term = self._terms.get(key)
    if term is None:
      term = self._terms[key] = self._random.getrandbits(64)
    return term

  def root(self, layout_ids: Sequence[int]) -> tuple[array.array, int]:
    """(each value's term, their sum) of a state."""
    terms = array.array("Q", (self.term(v, i) for v, i in enumerate(layout_ids)))
    return terms, sum(terms) & _MASK64

  def step(self, terms: array.array, layout: int, layout_ids: Sequence[int],
           changed: Sequence[int]) -> tuple[array.array, int]:
    """The terms and sum of a state that differs from (`terms`, `layout`) in `changed`."""
    terms = array.array("Q", terms)
    for v in changed:
      new = self.term(v, layout_ids[v])
      layout += new - terms[v]
      terms[v] = new
    return terms, layout & _MASK64

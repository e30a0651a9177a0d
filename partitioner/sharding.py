"""How a value is laid out over the mesh.

Per tensor dimension an ordered tuple of mesh axes (major to minor) that tile it, plus the axes
over which the local pieces are unreduced partial results (`partial`, combined with `reduce`).
Every other axis replicates the value. An axis appears at most once.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

Axes = tuple[str, ...]
Dims = tuple[Axes, ...]


class Sharding(NamedTuple):
  dims: Dims
  partial: Axes = ()
  reduce: str = "sum"

  @classmethod
  def replicated(cls, rank: int) -> "Sharding":
    return cls(((),) * rank)

  @property
  def axes(self) -> tuple[str, ...]:
    return tuple(a for d in self.dims for a in d) + self.partial

  @property
  def is_replicated(self) -> bool:
    return not any(self.dims) and not self.partial

  def spec(self):
    from jax.sharding import PartitionSpec
    return PartitionSpec(*spec_entries(self.dims))

  def __str__(self) -> str:
    return format_dims(self.dims) + (f" partial-{self.reduce}({','.join(self.partial)})"
                                     if self.partial else "")


def spec_entries(dims: Dims) -> list:
  """PartitionSpec entries: None, an axis name, or a tuple of names; trailing Nones dropped."""
  entries = [None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims]
  while entries and entries[-1] is None:
    entries.pop()
  return entries


def format_dims(dims: Dims) -> str:
  return "[" + ", ".join("+".join(d) if d else "-" for d in dims) + "]"


def shard_count(axes: Sequence[str], sizes: Mapping[str, int]) -> int:
  return math.prod(sizes[a] for a in axes)


def local_shape(shape: Sequence[int], dims: Dims, sizes: Mapping[str, int]) -> tuple[int, ...]:
  """The per-device shape of a value of global `shape` tiled as `dims`."""
  return tuple(n // shard_count(d, sizes) for n, d in zip(shape, dims))

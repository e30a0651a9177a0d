"""Resharding a value: the collectives that turn one sharding into another.

From a (possibly partial) source sharding to a target tiling:
1. partial axes that the target tiles on a dimension the source already agrees on become a
   reduce-scatter; the other partial axes an all-reduce (sum, max or min);
2. an axis that moves from one dimension to another becomes an all-to-all;
3. axes the target drops are all-gathered;
4. axes the target adds are local slices (free).
Bytes are per device and count the larger side (all-gather output, reduce-scatter input).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from partitioner.sharding import Axes, Dims

ALL_REDUCE = "all-reduce"
REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"
ALL_TO_ALL = "all-to-all"
COLLECTIVE_PERMUTE = "collective-permute"   # made by an op itself (`stage_shift`), not a reshard
SLICE = "slice"
KINDS = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)


class Step(NamedTuple):
  kind: str
  axes: Axes
  dim: int = -1         # gathered / scattered / sliced dim; for all-to-all the dim it leaves
  to_dim: int = -1      # all-to-all: the dim the axis moves to
  reduce: str = "sum"
  bytes: int = 0        # per device


class Collective(NamedTuple):
  """A collective the partitioner decided: on which value, at which op, over which axes."""
  kind: str
  axes: Axes
  bytes: int
  value: int
  op: int
  reduce: str = "sum"
  copy: int = -1        # the resharded operand copy it makes (-1: it reshards op's result)


def _common(a: Axes, b: Axes) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def reshard_steps(shape: Sequence[int], itemsize: int, src: Dims, partial: Axes, reduce: str,
                  dst: Dims, sizes: Mapping[str, int]) -> tuple[Step, ...]:
  """The steps that take a value laid out as (`src`, `partial`) to `dst`."""
  if not partial and tuple(src) == tuple(dst):
    return ()
  count = lambda axes: math.prod(sizes[a] for a in axes)
  cur = [tuple(d) for d in src]
  local = [n // count(d) for n, d in zip(shape, cur)]
  nbytes = lambda: math.prod(local) * itemsize
  steps: list[Step] = []
  pending = [a for a in partial if sizes[a] > 1]

  if pending and reduce == "sum":
    for d, (c, t) in enumerate(zip(cur, dst)):
      if len(t) > len(c) and t[: len(c)] == c:
        extra: Axes = ()
        for a in t[len(c):]:
          if a not in pending:
            break
          extra += (a,)
        if extra:
          steps.append(Step(REDUCE_SCATTER, extra, d, bytes=nbytes()))
          local[d] //= count(extra)
          cur[d] = c + extra
          pending = [a for a in pending if a not in extra]
  if pending:
    steps.append(Step(ALL_REDUCE, tuple(pending), reduce=reduce, bytes=nbytes()))

  for i in range(len(cur)):
    k = _common(cur[i], dst[i])
    drop = cur[i][k:]
    if len(drop) != 1:
      continue
    a = drop[0]
    for j in range(len(cur)):
      kj = _common(cur[j], dst[j])
      if j != i and kj == len(cur[j]) and dst[j][kj: kj + 1] == (a,):
        if sizes[a] > 1:
          steps.append(Step(ALL_TO_ALL, (a,), i, j, bytes=nbytes()))
        local[i] *= sizes[a]
        local[j] //= sizes[a]
        cur[i], cur[j] = cur[i][:-1], cur[j] + (a,)
        break

  for d in range(len(cur)):
    k = _common(cur[d], dst[d])
    drop = cur[d][k:]
    if drop:
      local[d] *= count(drop)
      cur[d] = cur[d][:k]
      if count(drop) > 1:
        steps.append(Step(ALL_GATHER, drop, d, bytes=nbytes()))

  for d in range(len(cur)):
    add = dst[d][len(cur[d]):]
    if add:
      local[d] //= count(add)
      cur[d] = dst[d]
      if count(add) > 1:
        steps.append(Step(SLICE, add, d))
  return tuple(steps)


def result_writes(result_steps: Sequence[Sequence[Step]]) -> tuple[tuple[int, bool], ...]:
  """Per result an op reshards: (its position, whether out of place, i.e. more than an
  all-reduce, which XLA runs in place)."""
  return tuple((k, any(s.kind != ALL_REDUCE for s in steps))
               for k, steps in enumerate(result_steps) if steps)


def summarize(collectives: Sequence[Collective]) -> list[dict]:
  """Collectives grouped by (kind, axes): count and total bytes per device."""
  groups: dict[tuple, dict] = {}
  for c in collectives:
    g = groups.setdefault((c.kind, c.axes), {"kind": c.kind, "axes": list(c.axes), "count": 0,
                                             "bytes": 0})
    g["count"] += 1
    g["bytes"] += c.bytes
  return sorted(groups.values(), key=lambda g: (-g["bytes"], g["kind"]))

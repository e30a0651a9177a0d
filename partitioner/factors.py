"""Factor notation for sharding rules, as in Shardy.

An op's rule names its *factors* (the loop dimensions of the op: `([i,k],[k,j])->([i,j])` for a
matmul) and maps every tensor dimension to a tuple of factors, major to minor (a reshape merges or
splits them). Each factor has a size and a kind:

- PASS: the factor indexes operands and results alike; sharding it needs no communication.
- SUM / MAX / MIN: the factor is reduced away; sharding it leaves the result partial, to be
  combined with that reduction.
- REPL: the op needs the factor whole (a sort axis, a padded dimension); it is never sharded.

Sharding then moves between tensors through factors: project a tensor's dims to factor axes,
merge the proposals of all tensors of the op, project back.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from partitioner.sharding import Axes

PASS, SUM, MAX, MIN, REPL = range(5)
KIND_NAMES = ("pass", "sum", "max", "min", "replicated")
REDUCE_OF_KIND = {SUM: "sum", MAX: "max", MIN: "min"}

DimFactors = tuple[tuple[int, ...], ...]  # per tensor dimension: factor ids, major to minor


class OpFactors(NamedTuple):
  operands: tuple[DimFactors, ...]
  results: tuple[DimFactors, ...]
  sizes: tuple[int, ...]
  kinds: tuple[int, ...]
  # Per factor, a group id, for ops that bundle independent tensors (the ends of a loop): a
  # mesh axis shards at most one factor of each group instead of one factor of the op.
  groups: tuple[int, ...] | None = None

  def describe(self) -> str:
    """`([i, k], [k, j]) -> ([i, j]) {k: sum}` with factors named i, j, k..."""
    names = [chr(ord("i") + f) if f < 18 else f"f{f}" for f in range(len(self.sizes))]

    def tensor(dims):
      return "[" + ", ".join("".join(names[f] for f in d) or "1" for d in dims) + "]"

    kinds = {names[f]: KIND_NAMES[k] for f, k in enumerate(self.kinds) if k != PASS}
    text = (f"({', '.join(tensor(d) for d in self.operands)}) -> "
            f"({', '.join(tensor(d) for d in self.results)})")
    return text + (f" {kinds}" if kinds else "")


class FactorBuilder:
  """Helps rules create factors and tensor mappings."""

  def __init__(self):
    self.sizes: list[int] = []
    self.kinds: list[int] = []

  def new(self, size: int, kind: int = PASS) -> int:
    self.sizes.append(int(size))
    self.kinds.append(kind)
    return len(self.sizes) - 1

  def dims(self, shape: Sequence[int], kind: int = PASS) -> DimFactors:
    """A fresh factor for every dimension of size > 1."""
    return tuple((self.new(n, kind),) if n > 1 else () for n in shape)

  def build(self, operands, results, groups=None) -> OpFactors:
    return OpFactors(tuple(tuple(o) for o in operands), tuple(tuple(r) for r in results),
                     tuple(self.sizes), tuple(self.kinds),
                     None if groups is None else tuple(groups))


def replicated_factors(operand_shapes, result_shapes) -> OpFactors:
  """The rule of an op we know nothing about: every dimension must be whole."""
  b = FactorBuilder()
  return b.build([b.dims(s, REPL) for s in operand_shapes],
                 [b.dims(s, REPL) for s in result_shapes])


def elementwise_factors(operand_shapes, result_shapes) -> OpFactors:
  """One shared factor per dimension of the result's shape; size-1 (broadcast) dimensions and
  scalar operands take none. Callers check that the shapes are compatible."""
  b = FactorBuilder()
  shape = tuple(result_shapes[0])
  common = b.dims(shape)

  def tensor(s):
    return tuple(common[d] if n == shape[d] else () for d, n in enumerate(s)) if s else ()

  return b.build([tensor(s) for s in operand_shapes], [tensor(s) for s in result_shapes])


def split_dim(axes: Axes, factors: tuple[int, ...], fsizes: Sequence[int],
              mesh: Mapping[str, int]) -> list[tuple[int, Axes]]:
  """Assigns a dimension's axes to its factors, filling the major factor first.

  Axes that no longer divide what is left of the current factor are dropped (the caller then
  sees a shorter projection and treats the rest as a conflict).
  """
  out: list[tuple[int, Axes]] = []
  i, rem, cur = 0, fsizes[factors[0]], []
  for a in axes:
    n = mesh[a]
    while rem == 1 and i + 1 < len(factors):
      out.append((factors[i], tuple(cur)))
      i, cur = i + 1, []
      rem = fsizes[factors[i]]
    if rem % n:
      break
    cur.append(a)
    rem //= n
  out.append((factors[i], tuple(cur)))
  return [(f, ax) for f, ax in out if ax]


def join_dim(factors: tuple[int, ...], fac_axes: Sequence[Axes], fsizes: Sequence[int],
             mesh: Mapping[str, int]) -> Axes:
  """The axes of a dimension made of several factors: concatenated while each factor is whole."""
  out: Axes = ()
  for f in factors:
    ax = fac_axes[f]
    out += ax
    n = 1
    for a in ax:
      n *= mesh[a]
    if n != fsizes[f]:
      break
  return out

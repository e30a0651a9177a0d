"""Sharding state and factor-based propagation to a fixed point.

Every op is visited through its factor rule: the shardings of its tensors are projected to
factor axes and merged (higher priority first: values sharded by earlier tactics, then larger
values, as Shardy prefers resharding the smaller tensor), then projected back onto every tensor
of the op. A tensor only ever gains axes on a dimension (refinement), so the process is monotone
and terminates; a later tactic can refine but never undo an earlier one. Disagreements are
recorded as conflicts with the values and axes involved; the lowering then reshards.

Propagation is incremental: it starts from the values a tactic changed and only visits ops that
those changes reach. What an op does to its tensors depends only on its rule, the shapes of its
tensors and their current shardings, so the outcome of a visit is remembered per op *class*
(ops alike in all three, e.g. the same matmul in every layer) and replayed: a tactic that shards
a parameter in every layer computes one layer's worth of rules.
"""

from __future__ import annotations

import collections
import heapq
import operator
from typing import NamedTuple, Sequence

from partitioner.errors import ShardingError
from partitioner.factors import REPL, OpFactors, join_dim, split_dim
from partitioner.ir import Program, per_program
from partitioner.mesh import Mesh
from partitioner.rules import op_factors
from partitioner.sharding import Axes, Dims, Sharding, format_dims

UNSHARDED = 1 << 30  # priority of a value no tactic has reached
MEMO_LIMIT = 1 << 18  # remembered op outcomes per program and mesh


def priority_order(prios):
  """Priorities as a merge sees them: only their order matters (and which are unsharded), so
  the same tuple with dense ranks lets states reached by different schedules share outcomes."""
  if not isinstance(prios, tuple):
    return 0 if prios < UNSHARDED else UNSHARDED
  rank = {p: i for i, p in enumerate(sorted(set(prios)))}
  rank[UNSHARDED] = UNSHARDED
  return tuple([rank[p] for p in prios])


class OpTensors(NamedTuple):
  factors: OpFactors
  tensors: tuple[tuple[int, tuple], ...]  # (value id, dim factors): operands, then results
  num_operands: int
  # Per tensor, the dims that can carry axes: (dim, factors), REPL-only dims left out.
  slots: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]
  vids: tuple[int, ...]                   # the value of each tensor
  klass: int                              # ops of one class have equal rules, shapes, aliasing
  pick: operator.itemgetter               # per-value list -> its items at `vids` (memo keys)


class Transfer(NamedTuple):
  """The outcome of visiting an op, by tensor position: conflicts met, then new dims to set."""
  conflicts: tuple[tuple[int, Axes, int, Axes], ...]   # (kept tensor, axes, dropped tensor, axes)
  updates: tuple[tuple[int, Dims, Axes, int], ...]     # (tensor, new dims, axes gained, layout_id)


class FactorTable:
  """Factor rules of every op of a program, computed once and shared by all states."""

  def __init__(self, program: Program):
    self.program = program
    self.entries: list[OpTensors | None] = [None] * len(program.ops)
    self.fallbacks: dict[int, str] = {}
    self.sizes = [v.size for v in program.values]
    self.producers = [v.producer for v in program.values]
    self._classes: dict[tuple, int] = {}
    self._memos: dict[Mesh, dict] = {}
    self._layouts: dict[Dims, int] = {}

  def layout_id(self, dims: Dims) -> int:
    """A small integer naming `dims` in every state of this program (there are few distinct
    layouts): memo keys built from these hash in one step, where nested tuples of axis names
    are rehashed item by item."""
    i = self._layouts.get(dims)
    if i is None:
      i = self._layouts[dims] = len(self._layouts)
    return i

  def memo(self, mesh: Mesh) -> dict:
    """Per mesh: op outcomes keyed by (op class, shardings of its tensors, ...); emptied when
    it grows past MEMO_LIMIT entries, so a long search keeps bounded memory."""
    memo = self._memos.get(mesh)
    if memo is None or len(memo) > MEMO_LIMIT:
      memo = self._memos[mesh] = {}
    return memo

  def __getitem__(self, index: int) -> OpTensors:
    entry = self.entries[index]
    if entry is None:
      op = self.program.ops[index]
      fac, reason = op_factors(op, self.program)
      if reason is not None:
        self.fallbacks[index] = reason
      tensors = tuple(zip(op.inputs, fac.operands)) + tuple(zip(op.outputs, fac.results))
      slots = tuple(tuple((d, fl) for d, fl in enumerate(dfs)
                          if fl and not (len(fl) == 1 and fac.kinds[fl[0]] == REPL))
                    for _, dfs in tensors)
      vids = tuple(v for v, _ in tensors)
      values = self.program.values
      signature = (fac, tuple(vids.index(v) for v in vids),
                   tuple((values[v].shape, values[v].dtype.itemsize, values[v].is_const)
                         for v in vids))
      klass = self._classes.setdefault(signature, len(self._classes))
      pick = operator.itemgetter(*vids) if vids else (lambda _: ())
      entry = self.entries[index] = OpTensors(fac, tensors, len(op.inputs), slots, vids, klass,
                                              pick)
    return entry

  @property
  def touching(self) -> list[tuple[int, ...]]:
    """Per value: the ops that read or make it, its producer last."""
    touching = self.__dict__.get("_touching")
    if touching is None:
      users = self.program.users
      touching = self._touching = [tuple(users[v]) + ((p,) if p is not None else ())
                                   for v, p in enumerate(self.producers)]
    return touching

  def all_fallbacks(self) -> dict[int, str]:
    for i in range(len(self.entries)):
      self[i]
    return self.fallbacks


@per_program
def factor_table(program: Program) -> FactorTable:
  return FactorTable(program)


class Origin(NamedTuple):
  """Why a value carries an axis: the tactic (schedule position) and the op that carried it
  there by propagation (None where the tactic set it directly)."""
  tactic: int
  op: int | None


class Conflict(NamedTuple):
  """Two tensors of an op want incompatible shardings; `kept` won, `dropped` will be resharded."""
  op: int
  primitive: str
  kept: str
  dropped: str
  tactic: int

  def __str__(self) -> str:
    return f"op #{self.op} {self.primitive}: kept {self.kept}, resharding {self.dropped}"


class ShardingState:
  """Per-value shardings with their origins and the axes tactics forbade. Cheap to copy.

  `prio[v]` is the earliest phase (one tile-then-propagate round of a tactic) that sharded v;
  merges let earlier phases win. `layout_ids[v]` is `table.layout_id(dims[v])`, what memo keys use.
  `changed` holds the values whose sharding or priority changed since the state was copied, so
  what is derived from the copy's source can be updated.
  """

  def __init__(self, program: Program, mesh: Mesh):
    self.program = program
    self.mesh = mesh
    self.sizes = mesh.sizes
    self.table = factor_table(program)
    self.dims: list[Dims] = [((),) * v.rank for v in program.values]
    self.layout_ids: list[int] = [self.table.layout_id(d) for d in self.dims]
    self.prio: list[int] = [UNSHARDED] * len(program.values)
    self.forbidden: dict[int, frozenset[str]] = {}
    self.origin: dict[tuple[int, str], Origin] = {}
    self._conflicts: list[tuple] = []   # (op, kept value, axes, dropped value, axes, tactic)
    self._conflict_keys: set = set()
    self.phase = 0  # priority of what is tiled now: earlier phases win merges.
    self.changed: set[int] = set(range(len(program.values)))

  def copy(self) -> "ShardingState":
    new = object.__new__(ShardingState)
    new.program, new.mesh, new.sizes, new.table = self.program, self.mesh, self.sizes, self.table
    new.dims, new.layout_ids = list(self.dims), list(self.layout_ids)
    new.prio = list(self.prio)
    new.forbidden = dict(self.forbidden)
    new.origin = dict(self.origin)
    new._conflicts = list(self._conflicts)
    new._conflict_keys = set(self._conflict_keys)
    new.phase = self.phase
    new.changed = set()
    return new

  def scratch(self) -> "ShardingState":
    """A copy for a dry run of tiles: its origins are layered over this state's, not copied."""
    new = object.__new__(ShardingState)
    new.__dict__.update(self.__dict__)
    new.dims, new.prio, new.forbidden = list(self.dims), list(self.prio), dict(self.forbidden)
    new.layout_ids = list(self.layout_ids)
    new.origin = collections.ChainMap({}, self.origin)
    new._conflicts, new._conflict_keys, new.changed = [], set(), set()
    return new

  def sharding(self, vid: int) -> Sharding:
    return Sharding(self.dims[vid])

  def describe(self, vid: int) -> str:
    return f"{self.program.name(vid)} {format_dims(self.dims[vid])}"

  def why(self, vid: int) -> list[str]:
    """For each axis on a value, which tactic put it there and through which op."""
    lines = []
    for d, axes in enumerate(self.dims[vid]):
      for a in axes:
        o = self.origin.get((vid, a))
        if o is None:
          continue
        via = "set directly" if o.op is None else (
            f"propagated through op #{o.op} ({self.program.ops[o.op].name})")
        lines.append(f"dim {d} on {a!r}: tactic #{o.tactic}, {via}")
    return lines

  # --------------------------------------------------------------------------- tactic edits
  def can_tile(self, vid: int, dim: int, axes: Sequence[str]) -> str | None:
    """Why tiling `dim` of a value over `axes` cannot be done now: the error `tile` would
    raise, or that the value has those axes already (None: `tile` would change it). What the
    environment masks a tile action by."""
    dim, new, problem = self._tile_plan(vid, dim, tuple(axes))
    if problem is None and not new:
      problem = (f"{self.program.name(vid)} is already sharded over "
                 f"{', '.join(map(repr, axes))} on dimension {dim}")
    return problem

  def _tile_plan(self, vid: int, dim: int, axes: tuple[str, ...]):
    """(the dimension, the axes tiling would add to it, why it cannot: None if it can)."""
    v = self.program.values[vid]
    name = lambda: self.program.name(vid)   # for errors only: a search tiles a lot
    if not -v.rank <= dim < v.rank:
      return dim, (), f"{name()} has rank {v.rank}; dimension {dim} does not exist"
    dim %= v.rank
    for a in axes:
      self.mesh.check_axis(a)
    cur = self.dims[vid]
    have = cur[dim]
    if axes[: len(have)] == have:
      new = axes[len(have):]
    elif all(a in have for a in axes):
      return dim, (), None
    else:
      new = tuple(a for a in axes if a not in have)
    for a in new:
      for d, other in enumerate(cur):
        if a in other:
          o = self.origin.get((vid, a))
          by = f" by tactic #{o.tactic}" if o else ""
          return dim, new, (f"{name()} is already sharded over {a!r} on dimension {d}{by}; "
                            f"it cannot also shard dimension {dim}")
      if a in self.forbidden.get(vid, ()):
        return dim, new, f"an earlier tactic keeps {name()} replicated over {a!r}"
    count = 1
    for a in have + new:
      count *= self.sizes[a]
    if v.shape[dim] % count:
      return dim, new, (f"{name()}: dimension {dim} of size {v.shape[dim]} is not divisible by "
                        f"{'x'.join(have + new)}={count}")
    return dim, new, None

  def tile(self, vid: int, dim: int, axes: Sequence[str], tactic: int) -> bool:
    """Adds `axes` (minor to what the dimension has) to `dim` of a value; False where it has
    them already. Raises on bad input."""
    dim, new, problem = self._tile_plan(vid, dim, tuple(axes))
    if problem is not None:
      raise ShardingError(problem)
    if not new:
      return False
    cur = self.dims[vid]
    have = cur[dim]
    dims = list(cur)
    dims[dim] = have + new
    self._set(vid, tuple(dims), new, Origin(tactic, None))
    return True

  def forbid(self, vid: int, axes: Sequence[str], tactic: int) -> None:
    """Keeps propagation from adding `axes` to a value (a closed, replicated choice)."""
    for a in axes:
      self.mesh.check_axis(a)
      for d, dim_axes in enumerate(self.dims[vid]):
        if a in dim_axes:
          o = self.origin.get((vid, a))
          raise ShardingError(
              f"{self.program.name(vid)}: cannot keep it replicated over {a!r}, dimension {d} was "
              f"sharded on it by tactic #{o.tactic if o else '?'}")
    self.forbidden[vid] = self.forbidden.get(vid, frozenset()) | frozenset(axes)

  def _set(self, vid: int, dims: Dims, added: Axes, origin: Origin) -> None:
    self.dims[vid] = dims
    self.layout_ids[vid] = self.table.layout_id(dims)
    self.changed.add(vid)
    for a in added:
      self.origin[(vid, a)] = origin
    if self.phase < self.prio[vid]:
      self.prio[vid] = self.phase

  # --------------------------------------------------------------------------- propagation
  def merge(self, index: int, conflicts: list | None = None) -> list[Axes]:
    """The op's factor axes agreed from the current shardings of its tensors. Disagreements
    are appended to `conflicts` as (kept tensor, its axes, dropped tensor, its axes)."""
    table = self.table
    fac, tensors, _, slots = (table.entries[index] or table[index])[:4]
    sizes_v = table.sizes
    dims, prio = self.dims, self.prio
    fac_axes: list[Axes] = [()] * len(fac.sizes)
    order = [(prio[v], -sizes_v[v], k) for k, (v, _) in enumerate(tensors) if prio[v] < UNSHARDED]
    if not order:
      return fac_axes
    if len(order) > 1:
      order.sort()
    kinds, groups = fac.kinds, fac.groups
    owner = [-1] * len(fac.sizes)
    used: dict = {}   # mesh axis (with groups: (group, axis)) -> the factor it shards
    for _, _, k in order:
      vdims = dims[tensors[k][0]]
      for d, flist in slots[k]:
        axes = vdims[d]
        if not axes:
          continue
        if len(flist) == 1:
          pairs = ((flist[0], axes),)
        else:
          pairs = [(f, ax) for f, ax in split_dim(axes, flist, fac.sizes, self.sizes)
                   if kinds[f] != REPL]
        for f, ax in pairs:
          cur = fac_axes[f]
          lc = len(cur)
          if lc:
            if ax[:lc] != cur:
              if conflicts is not None and cur[: len(ax)] != ax:
                conflicts.append((owner[f], cur, k, ax))
              continue
            if len(ax) == lc:
              continue
          new = cur
          for a in ax[lc:]:
            key = a if groups is None else (groups[f], a)
            g = used.get(key)
            if g is not None and g != f:
              if conflicts is not None:
                conflicts.append((owner[g], fac_axes[g], k, ax))
              break
            used[key] = f
            new += (a,)
          if len(new) != lc:
            fac_axes[f] = new
            owner[f] = k
    return fac_axes

  def _transfer(self, index: int) -> Transfer:
    """Visits op `index` without changing the state: merge, then project the agreed factor axes
    back onto each tensor where they refine it (and no axis is forbidden or used twice)."""
    fac, tensors, _, slots, vids = self.table[index][:5]
    conflicts: list = []
    fac_axes = self.merge(index, conflicts)
    updates = []
    if any(fac_axes):
      now = {v: self.dims[v] for v in vids}     # a value read twice sees its first update
      for k, v in enumerate(vids):
        vdims, new, gained = now[v], None, ()
        forb = self.forbidden.get(v)
        for d, flist in slots[k]:
          proj = (fac_axes[flist[0]] if len(flist) == 1 else
                  join_dim(flist, fac_axes, fac.sizes, self.sizes))
          if not proj:
            continue
          cur = vdims[d] if new is None else new[d]
          lc = len(cur)
          if len(proj) <= lc or proj[:lc] != cur:
            continue
          add: Axes = ()
          for a in proj[lc:]:
            if (forb is not None and a in forb) or any(a in dd for dd in (new or vdims)):
              break
            add += (a,)
          if add:
            new = new or list(vdims)
            new[d] = cur + add
            gained += add
        if new is not None:
          now[v] = tuple(new)
          updates.append((k, now[v], gained, self.table.layout_id(now[v])))
    return Transfer(tuple(conflicts), tuple(updates))

  @property
  def conflicts(self) -> list[Conflict]:
    """The disagreements propagation resolved, in the order it met them (named when read:
    a search never reads them)."""
    p = self.program
    return [Conflict(index, p.ops[index].name, f"{p.name(kept)} on {'+'.join(kept_axes)}",
                     f"{p.name(dropped)} on {'+'.join(dropped_axes)}", tactic)
            for index, kept, kept_axes, dropped, dropped_axes, tactic in self._conflicts]

  def _record_conflicts(self, index: int, vids, found, tactic: int) -> None:
    for kept, kept_axes, dropped, dropped_axes in found:
      key = (index, vids[kept], kept_axes, vids[dropped], dropped_axes)
      if key not in self._conflict_keys:
        self._conflict_keys.add(key)
        self._conflicts.append(key + (tactic,))

  def propagate(self, seeds: Sequence[int], tactic: int) -> int:
    """Spreads the shardings of `seeds` to a fixed point; returns the number of op visits."""
    program, table = self.program, self.table
    touching = table.touching
    entries = table.entries
    memo = table.memo(self.mesh)
    dims, layout, prio, forbidden, origin, changed = (
        self.dims, self.layout_ids, self.prio, self.forbidden, self.origin, self.changed)
    phase = self.phase
    queue: list[int] = []
    queued = bytearray(len(program.ops))
    heappush, heappop = heapq.heappush, heapq.heappop
    for vid in seeds:
      for u in touching[vid]:
        if not queued[u]:
          queued[u] = 1
          heappush(queue, u)
    visits = 0
    while queue:
      index = heappop(queue)
      queued[index] = 0
      visits += 1
      entry = entries[index] or table[index]
      pick = entry.pick
      key = (entry.klass, pick(layout), pick(prio),
             tuple(map(forbidden.get, entry.vids)) if forbidden else None)
      transfer = memo.get(key)
      if transfer is None:
        general = (key[0], key[1], priority_order(key[2]), key[3])
        transfer = memo.get(general)
        if transfer is None:
          transfer = memo[general] = self._transfer(index)
        memo[key] = transfer
      if transfer.conflicts:
        self._record_conflicts(index, entry.vids, transfer.conflicts, tactic)
      if not transfer.updates:
        continue
      why = tuple.__new__(Origin, (tactic, index))
      vids = entry.vids
      for k, new, gained, new_id in transfer.updates:
        v = vids[k]
        dims[v] = new
        layout[v] = new_id
        changed.add(v)
        for a in gained:
          origin[(v, a)] = why
        if phase < prio[v]:
          prio[v] = phase
        for u in touching[v]:   # every op touching v, but this one, again
          if u != index and not queued[u]:
            queued[u] = 1
            heappush(queue, u)
    return visits

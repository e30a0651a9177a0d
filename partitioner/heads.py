"""Attention heads padded to divide over a mesh axis (the `HeadPadding` tactic).

`Megatron` splits attention by heads, so 12 heads (GPT-2 small, BERT-base, ViT-base) over 8
devices stay whole on each. Held with zero heads up to a multiple of the axis (16), they split.
The padding is a `layouts.Padded` of the heads' factor (`unit`: how wide a head is in each
value), grown from each projection whose output features are split into heads through every
value indexed by them (the query, key, value and output projections, biases, scores,
probabilities, gradients, optimizer state); a fused projection's chunks are each padded and
then interleaved (`layouts.Interleaved.padded`). The step is then traced again keeping those
values so (`layouts._rewrite`), with the layouts' invariant: the padding stays zero, so the
zero heads add nothing to the results. Unlike the layouts found when a step is traced, it is
chosen by a plan, as it costs work wherever the plan does not split the heads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from partitioner.errors import ScheduleError
from partitioner.ir import Program, per_program
from partitioner.layouts import (_PADS, _PERMUTES, Interleaved, Padded, _factor_of, _grow,
                                 _held, _rewrite, _usable)
from partitioner.roles import _ELEMENTWISE


@per_program
def pad_heads(program: Program, m: int) -> Program:
  """The traced `program` with the heads of each attention whose head count `m` does not
  divide held padded with zero heads up to a multiple of `m` (its query, key, value and output
  projections, their gradients and optimizer state, and everything in between; a fused
  projection's chunks each padded, and interleaved), so that Megatron splits them over `m`
  devices; itself where every attention's heads divide, or none can be padded (grouped
  key/value heads that do not divide either, a scanned stack). The padded heads are zero, so
  they add nothing to the results; their work is the padding's price."""
  from partitioner.propagation import factor_table
  from partitioner.roles import roles
  from partitioner.tracing import abstract_args, trace
  raw = program.root
  held = _held(raw)
  table = factor_table(raw)
  params = frozenset(roles(raw).params)
  added: dict = {}
  projections = _projections(raw, table)
  for seed in projections:
    if not _pads(seed.heads, m) or seed.value in held or seed.value in added:
      continue
    members = _grow(raw, table, seed.value, seed.padding(m), _PADS)
    if (members is None or not _usable(raw, members) or not _fewest(members, projections, m)
        or any(v in held or v in added for v in members)):
      continue
    if seed.fused is not None:   # its chunks are padded alike; the fused projection is too
      upgrade = _padded_fused(raw, table, held, seed.fused, members)
      if upgrade is None:
        continue
      members.update(upgrade)
    if params.isdisjoint(members):
      continue
    added.update(members)
  if not added:
    return program
  try:
    out = _rewrite(raw, {**held, **added}, lambda f, shapes: trace(
        f, *abstract_args(raw, shapes), arg_names=raw.arg_names, loops="keep", layouts=False))
  except Exception as e:
    raise ScheduleError(f"the step could not be traced with its attention heads padded "
                        f"({type(e).__name__}: {e})") from e
  out.head_multiple = m   # a step traced again (at a micro-batch's size) is padded again
  return out


def padded_heads(program: Program) -> tuple[set[tuple[int, int]], int]:
  """The (heads, padded heads) pairs `pad_heads` padded the program's attentions by, and how
  many of its inputs it holds padded so."""
  pairs, count = set(), 0
  for lay in program.layouts.values():
    if isinstance(lay, Padded) and lay.unit:
      pairs.add((lay.size // lay.unit, lay.padded // lay.unit))
    count += bool(isinstance(lay, Padded) and lay.unit or
                  isinstance(lay, Interleaved) and lay.padded)
  return pairs, count


def _fewest(members: dict, projections: list[_Heads], m: int) -> bool:
  """Whether every projection the class pads gets the fewest heads that divide by `m`: not
  where padding one attention's keys and values (8 heads over 16 devices) would pad the query
  heads they are repeated for (32, which divide) as many times over."""
  return all(members[p.value] == p.padding(m) for p in projections
             if p.value in members and isinstance(members[p.value], Padded)
             and members[p.value].dim == p.dim)


def _padded_fused(program: Program, table, held: dict, fused: int, members: dict):
  """The interleaved class of the fused value whose chunks `members` pads, each of its
  values held padded as the chunks are; None if the chunks are not all padded alike or the
  value is not held interleaved."""
  lay = held.get(fused)
  if not isinstance(lay, Interleaved) or lay.padded:
    return None
  n = lay.chunks
  c = program.values[fused].shape[lay.dim] // n
  widths = set()
  for u in program.users[fused]:
    op = program.ops[u]
    if op.name == "slice":
      chunk = members.get(op.outputs[0])
      if not isinstance(chunk, Padded) or chunk.dim != lay.dim or chunk.size != c:
        return None
      widths.add(chunk.padded)
  if len(widths) != 1:
    return None
  width = widths.pop()
  fused_class = _grow(program, table, fused, lay, _PERMUTES)
  if fused_class is None or any(v in members for v in fused_class):
    return None
  return {v: k._replace(size=c * n, padded=width * n) for v, k in fused_class.items()}


class _Heads(NamedTuple):
  """A projection's output features split into heads: the weight (or a fused projection's
  chunk), its features' dimension and width, the heads, and the fused value it is a chunk of."""
  value: int
  dim: int
  width: int
  heads: int
  fused: int | None

  def padding(self, m: int) -> Padded:
    """Padded to the fewest heads that divide by `m`."""
    unit = self.width // self.heads
    return Padded(self.dim, self.width, math.ceil(self.heads / m) * m * unit, unit)


def _projections(program: Program, table) -> list[_Heads]:
  """Each forward-pass matmul weight whose output features, after elementwise ops (a bias),
  are split into heads; of a fused projection (`jnp.split(qkv, 3, -1)`), each chunk."""
  from partitioner.roles import _weight_matmuls, forward_ops, roles
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  found = []
  for w, dmap, fd, size, result, rdim in _weight_matmuls(program, params, forward):
    vid, d, heads = _to_heads(program, table, forward, result, rdim)
    if heads:
      found.append(_Heads(w, dmap[fd], size, heads, None))
    elif heads is None:   # a fused projection: its chunks
      for u in program.users[vid]:
        op = program.ops[u]
        if op.name == "slice" and u in forward:
          chunk = op.outputs[0]
          _, _, heads = _to_heads(program, table, forward, chunk, d)
          if heads:
            found.append(_Heads(chunk, d, program.values[chunk].shape[d], heads, vid))
  return found


def _pads(heads: int | None, m: int) -> bool:
  """Whether `heads` heads are padded to split `m` ways: not where they divide, nor one head
  (multi-query keys and values), which Megatron-LM replicates."""
  return heads is not None and heads > 1 and heads % m != 0


def _to_heads(program: Program, table, forward, vid: int, d: int):
  """Follows dimension `d` of `vid` through elementwise ops (a bias, a cast) to a reshape that
  splits it into heads: (value, dim, heads) there; (value, dim, None) where every reader is a
  slice (a fused projection's chunks); (None, None, 0) where it goes elsewhere."""
  for _ in range(8):
    users = [u for u in program.users[vid] if u in forward]
    if len(users) > 1 and all(program.ops[u].name == "slice" for u in users):
      return vid, d, None
    if len(users) != 1:
      break
    op, entry = program.ops[users[0]], table[users[0]]
    fl = _factor_of(entry, vid, d)
    if op.name == "reshape" and len(fl) >= 2:
      if any(t == (fl[0],) for t in entry.tensors[-1][1]):
        return vid, d, entry.factors.sizes[fl[0]]
      break
    if op.name not in _ELEMENTWISE or len(fl) != 1:
      break
    out = next((k for k, t in enumerate(entry.tensors[-1][1]) if t == fl), None)
    if out is None:
      break
    vid, d = op.outputs[0], out
  return None, None, 0

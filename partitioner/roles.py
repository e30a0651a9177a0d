"""What the values of a program are for, found from names and structure.

Tactics must find their targets in any model, not in hand-listed internals. Inputs are grouped
by the function's parameter names (`params`, `opt_state`, `batch`); the forward pass is what
the non-state outputs (the loss) depend on; Megatron pairs are found by following a weight's
output factor through the forward pass until another weight contracts it.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import NamedTuple

import numpy as np

from partitioner.factors import PASS, REPL, SUM, split_dim
from partitioner.ir import Program
from partitioner.propagation import factor_table

_PARAM = re.compile(r"param|weight|variables|state", re.I)  # model state: batch-norm stats
_OPT = re.compile(r"opt", re.I)


class Roles(NamedTuple):
  params: tuple[int, ...]
  opt_state: tuple[int, ...]
  data: tuple[int, ...]


def _top(name: str) -> str:
  return name.split("/", 1)[0]


def _is_key(v) -> bool:
  return v.dtype == np.uint32 and v.rank >= 1 and v.shape[-1] == 2 or v.dtype.kind == "V"


@functools.lru_cache(maxsize=64)
def roles(program: Program) -> Roles:
  params, opt, data = [], [], []
  for vid, name in zip(program.inputs, program.input_names):
    top = _top(name)
    if _OPT.search(top):
      opt.append(vid)
    elif _PARAM.search(top):
      params.append(vid)
    elif program.values[vid].rank >= 1 and not _is_key(program.values[vid]):
      data.append(vid)
  return Roles(tuple(params), tuple(opt), tuple(data))


def batch_inputs(program: Program, candidates) -> tuple[list[int], list[int]]:
  """The data inputs that carry the batch: the most common leading size (ties: the largest)."""
  sizes = collections.Counter(program.values[v].shape[0] for v in candidates)
  if not sizes:
    return [], []
  size = max(sizes, key=lambda s: (sizes[s], s))
  picked = [v for v in candidates if program.values[v].shape[0] == size]
  return picked, [v for v in candidates if v not in picked]


def aliased_outputs(program: Program, vid: int) -> tuple[int, ...]:
  """The outputs that are the updated version of input `vid` (new params for params)."""
  return program.aliased.get(vid, ())


@functools.lru_cache(maxsize=64)
def _params_by_path(program: Program) -> dict[str, int]:
  return {program.name(p).split("/", 1)[-1]: p for p in roles(program).params}


def matching_param(program: Program, opt_vid: int) -> int | None:
  """The parameter an optimizer-state leaf belongs to: same shape, the longest path suffix."""
  by_path = _params_by_path(program)
  parts = program.name(opt_vid).split("/")
  shape = program.values[opt_vid].shape
  for k in range(1, len(parts)):
    p = by_path.get("/".join(parts[k:]))
    if p is not None and program.values[p].shape == shape:
      return p
  return None


@functools.lru_cache(maxsize=64)
def forward_ops(program: Program) -> frozenset[int]:
  """Ops of the forward pass: those the non-state outputs (loss, metrics) depend on."""
  targets = [v for i, v in enumerate(program.outputs) if i not in program.aliases]
  if not targets or not program.aliases:
    return frozenset(range(len(program.ops)))
  seen, stack, ops = set(targets), list(targets), set()
  while stack:
    p = program.values[stack.pop()].producer
    if p is None or p in ops:
      continue
    ops.add(p)
    for v in program.ops[p].inputs:
      if v not in seen:
        seen.add(v)
        stack.append(v)
  return frozenset(ops)


@functools.lru_cache(maxsize=64)
def depends_on(program: Program, sources: tuple[int, ...]) -> frozenset[int]:
  """Values computed (transitively) from `sources`."""
  reached = set(sources)
  for op in program.ops:
    if any(v in reached for v in op.inputs):
      reached.update(op.outputs)
  return frozenset(reached)


def param_source(program: Program, vid: int, params: frozenset[int]):
  """If `vid` is a parameter seen through casts and transposes: (param, dim map), else None."""
  dims = list(range(program.values[vid].rank))
  while vid not in params:
    p = program.values[vid].producer
    if p is None:
      return None
    op = program.ops[p]
    if op.name in ("convert_element_type", "copy", "reduce_precision"):
      vid = op.inputs[0]
    elif op.name == "transpose":
      perm = op.params["permutation"]
      dims = [perm[d] for d in dims]
      vid = op.inputs[0]
    else:
      return None
  return vid, dims


class MegatronPair(NamedTuple):
  column: int          # the weight split along its output (free) dimension
  column_dim: int
  rows: tuple          # ((weight, dim), ...) that contract that dimension afterwards


@functools.lru_cache(maxsize=64)
def megatron_pairs(program: Program, axis_size: int) -> tuple[MegatronPair, ...]:
  """Column/row weight pairs: a weight's output dimension that flows, through pass-through
  ops only (no reduction over it), into the contracting dimension of other weights."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  table = factor_table(program)
  assigned: set[int] = set()
  pairs = []
  for op in program.ops:
    if op.name != "dot_general" or op.index not in forward:
      continue
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    sources = [param_source(program, v, params) for v in op.inputs]
    for side in (0, 1):
      src, other = sources[side], sources[1 - side]
      if src is None or other is not None or src[0] in assigned:
        continue
      w, dmap = src
      if program.values[w].rank < 2:
        continue
      contract, batch = (lc, lb) if side == 0 else (rc, rb)
      free = [d for d in range(program.values[op.inputs[side]].rank)
              if d not in contract and d not in batch]
      if not free:
        continue
      fd = free[0]
      if program.values[op.inputs[side]].shape[fd] % axis_size:
        continue
      # Result dim of that free dim: batch dims, then lhs free, then rhs free.
      lhs_free = [d for d in range(program.values[op.inputs[0]].rank) if d not in lc and d not in lb]
      rdim = len(lb) + (lhs_free.index(fd) if side == 0 else len(lhs_free) + free.index(fd))
      rows = _flow_to_rows(program, table, forward, params, op.outputs[0], rdim, axis_size, w)
      if rows:
        rows = tuple(r for r in rows if r[0] not in assigned and r[0] != w)
      if rows:
        pairs.append(MegatronPair(w, dmap[fd], rows))
        assigned.add(w)
        assigned.update(r[0] for r in rows)
  return tuple(pairs)


def _flow_to_rows(program, table, forward, params, start, start_dim, m, column):
  """Follows one sharded dimension forward; returns the weights that contract it, or None if
  it is reduced, needs replication, or reaches an output first."""
  mesh = {"_": m}
  users = program.users
  work, seen, rows = [(start, start_dim)], {(start, start_dim)}, []
  outputs = set(program.outputs)
  while work:
    vid, d = work.pop()
    if vid in outputs:
      return None
    for u in users[vid]:
      if u not in forward:
        continue
      fac, tensors, n_in = table[u][:3]
      for k in range(n_in):
        if tensors[k][0] != vid:
          continue
        flist = tensors[k][1][d]
        pairs = split_dim(("_",), flist, fac.sizes, mesh) if flist else []
        if not pairs:
          return None
        f = pairs[0][0]
        kind = fac.kinds[f]
        if kind == REPL:
          return None
        if kind != PASS:
          if kind != SUM or program.ops[u].name != "dot_general":
            return None
          other = tensors[1 - k]
          src = param_source(program, other[0], params)
          if src is None or src[0] == column:
            return None
          od = next(i for i, fl in enumerate(other[1]) if f in fl)
          rows.append((src[0], src[1][od]))
          continue
        for rv, rdfs in tensors[n_in:]:
          for rd, rfl in enumerate(rdfs):
            if f in rfl:
              if rfl[0] != f:
                return None
              if (rv, rd) not in seen:
                seen.add((rv, rd))
                work.append((rv, rd))
  return rows


@functools.lru_cache(maxsize=64)
def expert_weights(program: Program) -> tuple[tuple[int, int], ...]:
  """(parameter, expert dim) of weights that a forward-pass dot_general treats as a batch
  dimension: one weight slice per expert, as in `einsum("becd,edh->bech", x, w)`."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  found = []
  for op in program.ops:
    if op.name != "dot_general" or op.index not in forward:
      continue
    _, batch = op.params["dimension_numbers"]
    for side in (0, 1):
      src = param_source(program, op.inputs[side], params)
      if src is None:
        continue
      for d in batch[side]:
        entry = (src[0], src[1][d])
        if entry not in found:
          found.append(entry)
  return tuple(found)


@functools.lru_cache(maxsize=64)
def embedding_tables(program: Program) -> tuple[tuple[int, int], ...]:
  """(parameter, looked-up dim) of the forward pass's point-wise gathers from parameters."""
  params = frozenset(roles(program).params)
  forward = forward_ops(program)
  table = factor_table(program)
  found = []
  for op in program.ops:
    if op.name != "gather" or op.index not in forward:
      continue
    src = param_source(program, op.inputs[0], params)
    if src is None:
      continue
    fac = table[op.index].factors
    for d, fl in enumerate(fac.operands[0]):
      if fl and fac.kinds[fl[0]] == SUM:
        entry = (src[0], src[1][d])
        if entry not in found:
          found.append(entry)
  return tuple(found)

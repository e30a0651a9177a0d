"""Fused kernels: which ops run as one kernel, and so which values never reach HBM.

A hardware names one of two models (`Hardware.fusion`), each fitted to what XLA does there:

- `consecutive` (XLA:CPU, `docs/validation.md`'s CPU tables): runs of fusible ops that are
  consecutive in the order ops run, joined by values passed inside the run; a reduction fuses
  what it reads only where XLA:CPU's rules let it (`_cpu_fuses_operand`).
- `producer` (XLA:GPU, measured on an H100 from the kernels of XLA's optimised programs): an
  elementwise or shape op fuses into the ops that read its result when all of them can fuse it,
  wherever they run (a scatter-add fuses the producers of its updates, and ends its kernel).
  A result read by several kernels is recomputed in each (XLA duplicates it)
  unless that re-reads more bytes than writing it once and reading it in each kernel; then it is
  stored, as XLA's priority fusion decides. Reductions end a kernel; a kernel runs where its last
  op (its root) runs.

Either way a value is `internal` (passed inside a kernel) only if every reader is in a kernel
that makes it; a fused op computed in several kernels reads its own operands once in each
(its `read_scale` counts them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:
  from partitioner.ir import Program

MODELS = ("consecutive", "producer")


class Kernels(NamedTuple):
  group: np.ndarray      # per op: its kernel (the first, if recomputed in several), in run order
  groups: int            # how many kernels
  internal: np.ndarray   # per value: passed inside kernels, never stored
  read_scale: np.ndarray  # per op: the share of its operands' bytes it reads, in all copies
  last_run: np.ndarray   # per op: the program position of the last kernel that computes it


def kernels(program: Program, order: Sequence[int], fusible: Sequence[bool],
            is_reduce: Sequence[bool], read_scale: np.ndarray, model: str) -> Kernels:
  if model == "consecutive":
    return _consecutive(program, order, fusible, is_reduce, read_scale)
  if model == "producer":
    return _producer(program, order, fusible, is_reduce, read_scale)
  raise ValueError(f"unknown fusion model {model!r}; known: {', '.join(MODELS)}")


def _consecutive(program, order, fusible, is_reduce, read_scale) -> Kernels:
  """A value stays in a kernel when a fusible op makes it and all its readers are in the same
  kernel; reductions end a kernel (their result is needed whole before it is used), and a value
  a reduction reads stays in memory if anything else reads it too (softmax's exp) or if the
  reduction does not fuse what it reads (`_cpu_fuses_operand`)."""
  ops, users = program.ops, program.users
  outputs = set(program.outputs)
  fuses = [fusible[op.index] and (not is_reduce[op.index] or _cpu_fuses_operand(op, program))
           for op in ops]
  candidate = np.zeros(len(program.values), bool)
  for op in ops:
    if fusible[op.index] and not is_reduce[op.index]:
      for v in op.outputs:
        readers = users[v]
        candidate[v] = (v not in outputs and bool(readers) and
                        all(fuses[u] for u in readers) and
                        not (len(readers) > 1 and any(is_reduce[u] for u in readers)))
  producer = [v.producer for v in program.values]
  group, current, previous = [0] * len(ops), -1, -1
  region = _regions(program)
  for i in order:
    joins = (fusible[i] and current >= 0 and previous >= 0 and fusible[previous] and
             region[i] == region[previous] and
             any(candidate[v] and group[producer[v]] == current for v in ops[i].inputs
                 if producer[v] is not None))
    if not joins:
      current += 1
    group[i] = current
    previous = i
  internal = np.zeros(len(program.values), bool)
  for v in np.nonzero(candidate)[0]:
    g = group[producer[v]]
    internal[v] = all(group[u] == g for u in users[v])
  n = len(ops)
  return Kernels(np.array(group, np.int64), current + 1, internal,
                 np.asarray(read_scale, np.float64), np.arange(n, dtype=np.int64))


# XLA:CPU rewrites a reduction with a reduced dimension longer than this into a reduce-window
# of this size and a reduction of its result, for accuracy (TreeReductionRewriter, run before
# fusion with its default window of 32).
CPU_TREE_REDUCTION_WINDOW = 32


def _cpu_fuses_operand(op, program) -> bool:
  """Whether XLA:CPU computes a reduction's operand inside the reduction's kernel. Not when a
  reduced dimension is longer than `CPU_TREE_REDUCTION_WINDOW` (the tree-reduction rewrite puts
  a reduce-window in front, and XLA:CPU fuses nothing into a reduce-window), nor when the
  reduction leaves the minor (last) dimension (cpu_instruction_fusion: "not fusing reductions
  over major dimensions"). The shapes are the program's, not a device's: a reduced dimension
  split so finely that its share is 32 or less is still counted as rewritten."""
  shape = program.values[op.inputs[0]].shape
  axes = {a % len(shape) for a in op.params.get("axes", ())} if shape else set()
  variadic = op.name in ("argmax", "argmin")   # value and index: the rewrite skips these
  return (len(shape) - 1 in axes and
          (variadic or all(shape[a] <= CPU_TREE_REDUCTION_WINDOW for a in axes)))


def _producer(program, order, fusible, is_reduce, read_scale) -> Kernels:
  ops, values, users = program.ops, program.values, program.users
  outputs = set(program.outputs)
  region = _regions(program)
  producer = np.array([-1 if v.producer is None else v.producer for v in values], np.int64)
  nbytes = np.array([v.nbytes for v in values], np.float64)
  internal = np.zeros(len(values), bool)
  # A bitcast (scale 0) moves nothing on its own; fused into a kernel, that kernel reads its
  # operand.
  bitcast = np.asarray(read_scale) == 0
  read_scale = np.where(bitcast, 1.0, read_scale)
  # What a kernel reads to compute an op inside it: its stored operands and, for operands
  # computed inside the kernel too, what those read.
  reads = np.zeros(len(ops))
  for op in ops:
    i = op.index
    reads[i] = sum(reads[producer[v]] if internal[v] else nbytes[v] * read_scale[i]
                   for v in op.inputs)
    if not fusible[i] or is_reduce[i]:
      continue
    for v in op.outputs:
      readers = set(users[v])
      fuses = (v not in outputs and bool(readers) and
               all((fusible[u] or _absorbs(ops[u], v)) and region[u] == region[i]
                   for u in readers))
      if fuses and len(readers) > 1:   # recomputed in each reader, or stored once
        fuses = reads[i] * len(readers) <= nbytes[v] * (1 + len(readers))
      internal[v] = fuses
  roots = [op.index for op in ops
           if not fusible[op.index] or not op.outputs or
           not all(internal[v] for v in op.outputs)]
  position = np.empty(len(ops), np.int64)
  position[np.asarray(order, np.int64)] = np.arange(len(ops))
  roots.sort(key=lambda r: position[r])
  group = np.full(len(ops), -1, np.int64)
  copies = np.zeros(len(ops))
  last_run = np.arange(len(ops), dtype=np.int64)
  for k, root in enumerate(roots):
    seen, stack = set(), [root]
    while stack:
      i = stack.pop()
      if i in seen:
        continue
      seen.add(i)
      copies[i] += 1
      if group[i] < 0:
        group[i] = k
      last_run[i] = max(last_run[i], root)
      stack.extend(int(producer[v]) for v in ops[i].inputs if internal[v])
  # Every op is in a kernel: a result is internal only if all its readers fuse it, so chains
  # of internal results end at a root.
  stored = np.zeros(len(ops), bool)
  stored[roots] = True
  return Kernels(group, len(roots), internal,
                 np.where(stored & bitcast, 0.0, read_scale) * copies, last_run)


def _absorbs(op, v: int) -> bool:
  """Whether an op that ends a kernel computes its operand `v` inside it: a scatter's updates
  (XLA:GPU fuses their elementwise producers into the scatter, whose operand it updates in
  place)."""
  return op.name == "scatter-add" and len(op.inputs) == 3 and op.inputs[2] == v


def _regions(program: Program):
  return program.region_of if program.regions else np.full(len(program.ops), -1)

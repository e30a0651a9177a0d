"""Folding a deep layer stack into a three-layer program with multiplicities.

A tactic applied to a stack of identical layers shards every layer alike (decision points
group a parameter across layers), so layers 1 to L-2 of an L-layer program are partitioned,
costed and communicate alike. The three-layer trace of the same model keeps what differs
(the first layer reads the embedding, the last feeds the head) and one middle layer standing
for L-2: its ops count L-2 times, and so do the buffers that outlive the middle layer's
blocks (its parameters, optimizer state, gradients, activations kept for the backward pass).
Everything derived per step (propagation, plan, mask, observation) then runs on three layers
instead of L.

The middle layer is found without names: the three-layer trace is the two-layer trace with
blocks of ops inserted (a forward block, a backward block, optimizer blocks). Each inserted
block is moved, within the run of equal blocks it belongs to, to the copy that reads the most
of what the middle blocks before it read or made (the backward that reads the middle layer's
activations, the updates of its parameters), and where that does not tell, to the middle of
the run: layer 1 of 0, 1, 2.
"""

from __future__ import annotations

import difflib
from typing import NamedTuple

import numpy as np

from partitioner.ir import Program


class Buffers(NamedTuple):
  """How many buffers of the deep program each value of the shallow one stands for."""
  value_weight: np.ndarray   # per value
  # Per value: the first and last op of the middle block that makes it and of the one that
  # reads it last (-1: none). The deep program runs such a block once per middle layer, so a
  # buffer standing for several is made (or dropped) a layer at a time across it.
  made_in: np.ndarray        # (values, 2)
  dropped_in: np.ndarray     # (values, 2)


class Folding(NamedTuple):
  """A shallow program standing for a deep one."""
  program: Program           # the three-layer trace
  depth: int                 # layers of the program it stands for
  op_weight: np.ndarray      # per op: how many ops of the deep program it stands for
  middle: np.ndarray         # per op: in the middle layer
  block: np.ndarray          # per op: the run of middle or outer ops it belongs to

  def buffers(self, last_run: np.ndarray | None = None,
              internal: np.ndarray | None = None) -> Buffers:
    """A buffer stands for depth - 2 when the deep program holds one per middle layer at once:
    the middle layer's parameters and optimizer state (inputs it reads last), and what one of
    its blocks hands to another (kept activations, gradients for the optimizer, its new
    parameters). What one block makes and drops, or hands along a chain between layers (a
    gradient flowing back), is live for one layer at a time. `last_run` (per op): where a
    fused op's operands are last read, when a later kernel computes it again; `internal` (per
    value): computed inside a kernel, never stored (`memory.bufferless`)."""
    three, middle, block, depth = self.program, self.middle, self.block, self.depth
    outputs = set(three.outputs)
    value_weight = np.ones(len(three.values))
    first = np.searchsorted(block, block, side="left")
    last = np.searchsorted(block, block, side="right") - 1
    made_in = np.full((len(three.values), 2), -1, np.int64)
    dropped_in = np.full((len(three.values), 2), -1, np.int64)
    from partitioner.cost.memory import bufferless, readers_with_views
    # A value read through a view or a fused conversion is read where those are (it is what
    # the deep program stores).
    for v, readers in enumerate(readers_with_views(three, bufferless(three, internal))):
      # A middle op fused into a kernel that runs after the middle layer (the optimizer's, a
      # global norm's) reads the value there, every layer's copy of it at once.
      late = last_run is not None and any(
          middle[r] and not middle[last_run[r]] for r in readers)
      if last_run is not None:
        readers = sorted(set(readers) | {int(last_run[r]) for r in readers})
      producer = three.values[v].producer
      if v in outputs or not readers:   # every middle layer makes one, kept to the end
        stands = v in outputs and producer is not None and middle[producer]
      elif late:
        stands = producer is None or bool(middle[producer])
      elif not middle[readers[-1]]:
        stands = False
      elif producer is None:
        stands = True
      else:
        blocks = {block[r] for r in readers if middle[r]}
        if middle[producer]:
          blocks.add(block[producer])
        stands = len(blocks) >= 2
      if stands:
        value_weight[v] = depth - 2
        if producer is not None and middle[producer]:
          made_in[v] = first[producer], last[producer]
        if (readers and producer is not None and v not in outputs and
            middle[readers[-1]]):   # else it lives to the end, or to a reader past the middle
          dropped_in[v] = first[readers[-1]], last[readers[-1]]
    return Buffers(value_weight, made_in, dropped_in)


def _signature(program: Program, op) -> tuple:
  values = program.values
  return (op.name, tuple(values[v].shape for v in op.inputs),
          tuple(values[v].shape for v in op.outputs))


def _repeated(b: list, j1: int, j2: int) -> int:
  """The length of an inserted piece if a neighbouring block of its length is the same ops
  (a layer's copy), else 0."""
  n = j2 - j1
  return n if b[max(j1 - n, 0):j1] == b[j1:j2] or b[j2:j2 + n] == b[j1:j2] else 0


def _inserts(opcodes, b: list, short: int = 8) -> list[tuple[int, int]]:
  """The inserted pieces of `b`. Where a few matched ops sit between two inserts, the diff may
  have matched them inside what was inserted (a run of per-parameter reductions, ordered by
  parameter, then their sum: current JAX's global norm): they are placed again where the
  inserted pieces around them come out as copies of a neighbouring block, as a layer does."""
  pieces = [(tag, j1, j2) for tag, _, _, j1, j2 in opcodes]
  out, k = [], 0
  while k < len(pieces):
    tag, j1, j2 = pieces[k]
    if tag == "equal":
      k += 1
      continue
    if k + 2 < len(pieces) and pieces[k + 1][0] == "equal" and pieces[k + 2][0] == "insert" \
        and pieces[k + 1][2] - pieces[k + 1][1] <= short:
      e1, e2 = pieces[k + 1][1:]
      end = pieces[k + 2][2]
      kept = b[e1:e2]
      places = [p for p in range(j1, end - len(kept) + 1) if b[p:p + len(kept)] == kept]
      p = max(places, key=lambda p: (_repeated(b, j1, p) + _repeated(b, p + len(kept), end),
                                     p == e1))
      pieces[k + 2] = ("insert", p + len(kept), end)
      if p > j1:
        out.append((j1, p))
      k += 2
      if p + len(kept) == end:
        k += 1
      continue
    out.append((j1, j2))
    k += 1
  return out


def fold(two: Program, three: Program, depth: int) -> Folding | None:
  """`three` (the model at three layers) weighted to stand for `depth` layers, given the same
  model at two layers; None when `three` is not `two` with blocks of ops inserted."""
  if depth <= 3:
    raise ValueError(f"folding needs more than three layers, got {depth}")
  a = [_signature(two, op) for op in two.ops]
  b = [_signature(three, op) for op in three.ops]
  opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
  if any(tag not in ("equal", "insert") for tag, *_ in opcodes):
    return None
  middle = np.zeros(len(b), bool)
  touched = np.zeros(len(three.values), bool)   # read or made by the middle blocks
  for j1, j2 in _inserts(opcodes, b):
    n, block = j2 - j1, b[j1:j2]
    lo, hi = j1, j2
    while lo >= n and b[lo - n:lo] == block:
      lo -= n
    while hi + n <= len(b) and b[hi:hi + n] == block:
      hi += n
    # Position alone can mislead: where one layer's backward differs from the others (t5's
    # decoder) the run is two blocks long, and which of the two is layer 1 shows in what it
    # reads.
    center = lo + (hi - lo) // n // 2 * n
    start = max(range(lo, hi, n), key=lambda s: (
        sum(touched[v] for op in three.ops[s:s + n] for v in op.inputs), -abs(s - center)))
    middle[start:start + n] = True
    for op in three.ops[start:start + n]:
      touched[list(op.inputs) + list(op.outputs)] = True
  if not middle.any():
    return None
  op_weight = np.where(middle, depth - 2, 1).astype(np.float64)
  block = np.cumsum(np.concatenate([[0], middle[1:] != middle[:-1]]))
  return Folding(three, depth, op_weight, middle, block)

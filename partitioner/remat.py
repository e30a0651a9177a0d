"""Activation recomputation (rematerialisation) as a rewrite of the traced step.

A step's backward pass reads what its forward pass computed, so each activation lives from the
forward pass to the backward. At a 4,096-token sequence a 7B model's attention probabilities
alone are over an 80 GB card whatever the plan splits. `remat(program)` keeps only the values
at the narrowest cuts of the forward pass and computes the rest again, segment by segment, just
before the backward pass reads them: what `jax.checkpoint` around every layer (Megatron-LM's
full recomputation, HF Flax's `gradient_checkpointing`) does, for one more forward pass of work,
on a step whose author did not write it.

Found from the dataflow, without names or a layer structure:

- the forward pass is every op the gradient's seed does not start (`roles.backward_ops`); a cut
  between two of its ops carries the forward values made before it and read by forward ops
  after it;
- the cuts at or under a threshold of bytes are the segments' bounds, and the threshold is the
  one that keeps least live in the backward pass: the values that cross a bound (kept, as the
  later segments' recomputation reads them) plus the largest segment's activations (live while
  its backward pass runs). In a layer stack the cuts carrying the residual stream alone win:
  between layers and between a layer's attention and feed-forward blocks;
- each segment's values that the backward pass reads, but the one whose backward pass comes
  first (nothing runs between its forward and backward pass), are computed again from what
  enters the segment, through an `optimization_barrier` as JAX lowers a differentiated
  `checkpoint`, so that XLA does not merge the two computations; the backward pass reads those.

The same ops on the same operands give the same bits, so the partitioned step still matches the
user's exactly. The rewrite is an ordinary straight-line program: tactics, both lowerings and the
cost model (one more forward pass of work, smaller peaks) treat it as any other.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import roles as R
from partitioner.errors import ScheduleError
from partitioner.ir import Program, bind, per_program

_LEVELS = 256   # thresholds tried: the distinct cut sizes, or this many of their quantiles


class Recomputation(NamedTuple):
  """Where `remat` cut a program's forward pass (op indices of the program it rewrote)."""
  bounds: tuple[int, ...]     # the forward ops that begin a segment
  segments: int               # segments recomputed
  ops: int                    # forward ops computed again
  kept_bytes: int             # activations kept across the backward pass (the bounds' values)
  recomputed_bytes: int       # activations computed again instead of kept
  activation_bytes: int       # every forward value the backward pass reads, unrewritten

  def again(self, program: Program) -> Program:
    """`program` (the step traced again, at a micro-batch's size) recomputed at these cuts."""
    return remat(program, self.bounds)


def _refuse(why: str):
  raise ScheduleError(f"Remat: {why}")


def rematerialised(program: Program) -> Recomputation | None:
  """The recomputation a rewrite by `remat` made `program` with, if one did."""
  while program is not None:
    if getattr(program, "recomputation", None) is not None:
      return program.recomputation
    program = program.original
  return None


def remat(program: Program, bounds: tuple[int, ...] | None = None) -> Program:
  """The step with its activations computed again in the backward pass (module docstring);
  `bounds` (forward op indices that begin a segment) fixes the cuts, as when the step is
  traced again at a micro-batch's size."""
  why = refusal(program)
  if why is not None:
    _refuse(why)
  return _remat(program, bounds)


def refusal(program: Program) -> str | None:
  """Why `remat` refuses the step as it is written (None: it looks for cuts), without looking
  for them: the environment offers `Remat()` only where this is None."""
  if rematerialised(program) is not None:
    return "the step recomputes its activations already (Remat came twice)"
  if program.microbatches > 1 or program.stages > 1:
    return ("put it before Microbatch and Pipeline: it rewrites the step as traced, and their "
            "loops keep one micro-batch's activations")
  if program.regions:
    return ("the step keeps a loop (a scanned layer stack), whose body it cannot reach into: "
            "wrap the loop's body in jax.checkpoint (nn.remat, hk.remat) instead")
  if any(op.primitive.name == "optimization_barrier" for op in program.ops):
    return "the step recomputes already (it was written with jax.checkpoint)"
  return None


@per_program
def _remat(program: Program, bounds) -> Program:
  """Made once per program and cuts: a search tries one rewrite under many schedules."""
  plan = _plan(program, bounds)
  if not plan.segments:
    _refuse("found nothing to recompute: the step has no backward pass (jax.grad), or no cut "
            "of its forward pass keeps less than its activations")
  return _emit(program, plan)


class _Plan(NamedTuple):
  recomputation: Recomputation
  segments: dict              # insertion op -> [(segment's ops in order, values it rewrites)]


def _plan(program: Program, bounds) -> _Plan:
  backward = R.backward_ops(program)
  if not backward:
    return _Plan(Recomputation((), 0, 0, 0, 0, 0), {})
  data = R.depends_on(program, tuple(R.roles(program).data))
  forward = [op.index for op in program.ops if op.index not in backward]
  in_forward = np.zeros(len(program.ops), bool)
  in_forward[forward] = True
  pos = np.full(len(program.ops), -1)
  pos[forward] = np.arange(len(forward))
  n, values, users = len(forward), program.values, program.users
  # Per activation (a value of the forward side computed from the data; weights' copies and
  # the like are kept as they are): where it is made and last read on the forward side, its
  # size, and the first backward op that reads it.
  made, last, nbytes, backward_first = [], [], [], []
  vids = []
  for p in forward:
    for v in program.ops[p].outputs:
      if v not in data:
        continue
      readers = users[v]
      f = [pos[u] for u in readers if in_forward[u]]
      b = [u for u in readers if not in_forward[u]]
      vids.append(v)
      made.append(pos[p])
      last.append(max(f) if f else pos[p])
      nbytes.append(values[v].nbytes)
      backward_first.append(min(b) if b else -1)
  if not vids:
    return _Plan(Recomputation((), 0, 0, 0, 0, 0), {})
  made, last = np.array(made), np.array(last)
  nbytes, backward_first = np.array(nbytes, np.int64), np.array(backward_first)
  residual = backward_first >= 0
  activation_bytes = int(nbytes[residual].sum())

  def segments_of(cut_at: np.ndarray) -> np.ndarray:   # per forward position: its segment
    return np.cumsum(cut_at)

  if bounds is None:
    crossing = np.zeros(n + 1, np.int64)   # cut c lies before forward position c
    np.add.at(crossing, made + 1, nbytes)
    np.add.at(crossing, last + 1, -nbytes)
    crossing = np.cumsum(crossing)[:n]
    inner = crossing[1:]
    levels = np.unique(inner)
    if len(levels) > _LEVELS:
      levels = np.unique(np.quantile(levels, np.linspace(0, 1, _LEVELS), method="lower"))
    best = None
    for t in levels:
      cut_at = np.concatenate([[False], inner <= t])
      seg = segments_of(cut_at)
      crosses = seg[last] > seg[made]
      kept = int(nbytes[crosses].sum())
      live = np.bincount(seg[made[residual & ~crosses]],
                         weights=nbytes[residual & ~crosses], minlength=seg[-1] + 1)
      cost = kept + (live.max() if len(live) else 0)
      if best is None or cost < best[0]:
        best = (cost, cut_at)
    cut_at = best[1]
  else:
    cut_at = np.zeros(n, bool)
    for op in bounds:
      if op < 0 or op >= len(program.ops) or not in_forward[op]:
        _refuse(f"op {op} begins no segment of this step's forward pass: it traces "
                "differently from the step its cuts were found on")
      cut_at[pos[op]] = True
    cut_at[0] = False
  seg = segments_of(cut_at)
  crosses = seg[last] > seg[made]
  recompute = residual & ~crosses
  by_segment: dict[int, list[int]] = {}
  for i in np.flatnonzero(recompute):
    by_segment.setdefault(int(seg[made[i]]), []).append(i)
  # A segment is computed again just before the backward pass first reads it, but the one it
  # reads first: its forward and backward passes follow one another.
  at = {s: int(backward_first[idx].min()) for s, idx in by_segment.items()}
  if at:
    del at[min(at, key=lambda s: (at[s], -s))]
  segment_of_op = np.full(len(program.ops), -1)
  segment_of_op[forward] = seg
  plan: dict[int, list] = {}
  ops_again = recomputed = 0
  for s in sorted(at):
    targets = [vids[i] for i in by_segment[s]]
    needed, stack = set(), [values[v].producer for v in targets]
    while stack:
      p = stack.pop()
      if p in needed:
        continue
      needed.add(p)
      for v in program.ops[p].inputs:
        q = values[v].producer
        if q is not None and segment_of_op[q] == s:
          stack.append(q)
    plan.setdefault(at[s], []).append((tuple(sorted(needed)), tuple(targets)))
    ops_again += len(needed)
    recomputed += int(sum(values[v].nbytes for v in targets))
  kept = int(nbytes[crosses & residual].sum()) if at else activation_bytes
  bounds_out = tuple(int(forward[c]) for c in np.flatnonzero(cut_at))
  return _Plan(Recomputation(bounds_out, len(at), ops_again, kept, recomputed, activation_bytes),
               plan)


def _emit(program: Program, plan: _Plan) -> Program:
  """The step with each segment's ops run again before the backward op that first reads them,
  traced into the new program."""
  from jax import lax

  from partitioner.microbatch import input_env, traced_step
  values = program.values

  def again(env, ops, targets):
    mine = {o for p in ops for o in program.ops[p].outputs}
    entering = sorted({v for p in ops for v in program.ops[p].inputs
                       if v not in mine and not values[v].is_const})
    through = lax.optimization_barrier(tuple(env[v] for v in entering)) if entering else ()
    local = dict(zip(entering, through))
    for p in ops:
      op = program.ops[p]
      outs = bind(op, [local[v] if v in local else env[v] for v in op.inputs], op.params)
      local.update(zip(op.outputs, outs))
    for v in targets:   # the backward pass reads these from here on
      env[v] = local[v]

  def step(*flat):
    env = input_env(program, flat)
    for op in program.ops:
      for ops, targets in plan.segments.get(op.index, ()):
        again(env, ops, targets)
      for vid, x in zip(op.outputs, bind(op, [env[v] for v in op.inputs], op.params)):
        env[vid] = x
    return [env[v] for v in program.outputs]

  out = traced_step(program, step)
  out.source, out.original, out.loops = program.source, program, program.loops
  out.head_multiple = program.head_multiple
  out.recomputation = plan.recomputation
  return out

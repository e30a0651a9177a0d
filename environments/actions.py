"""The action space of a task: tile a decision point, apply a manual tactic, cut the batch
into micro-batches or recompute the activations (either ends the episode), or finish.

A decision point is a set of function inputs that one tactic would treat alike: the same
parameter in every layer (`params/gpt/layer_*/attn/query/w`), the optimizer state of those
parameters (`opt_state/**/layer_*/attn/query/w`), a data input. Tiling one shards a whole
role at once, and its glob pattern is exactly its members, so the action is written as a
`Tile` tactic that `shardzero partition --tactics` replays.

`Microbatch(k)` rewrites the program the tactics shard, so it comes first in a schedule; as an
action it comes last: it ends the episode with the plan so far replayed on the step cut into
k micro-batches. Plans that do not fit for their activations fit so, and where no plan of the
whole batch fits (a 7B model at one sequence a device), it is the only answer that does.
`Remat()` ends an episode the same way, the plan replayed on the step that computes its
activations again in the backward pass (`partitioner.remat`): at one sequence a device it is
the faster of the two (HF Llama 7B on 256 H100s: 1.40 s where the best cut is 1.79 s).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

from partitioner import roles as R
from partitioner.errors import ShardzeroError
from partitioner.ir import Program
from partitioner.mesh import Mesh
from partitioner.propagation import ShardingState
from partitioner.tactics import (BatchParallel, EmbeddingSharding, ExpertParallel, Megatron,
                                 Microbatch, Remat, SequenceParallel, Tactic, Tile, ZeRO,
                                 tactic_problem)

ROLES = ("param", "opt", "data")
# The manual tactics an agent may apply, per mesh axis; the action feature `kind` indexes this.
TACTIC_KINDS = ("tile", "BatchParallel", "Megatron", "ZeRO", "EmbeddingSharding",
                "ExpertParallel", "SequenceParallel", "Microbatch", "Remat", "finish")
MICROBATCHES = (2, 4, 8, 16)   # the micro-batch counts an episode may end with
# The kinds of the actions that rewrite the step, replay the plan on it and end the episode.
ENDINGS = ("Microbatch", "Remat")


def ends_episode(name: str) -> bool:
  """Whether an action, by its name (`Microbatch(4)`, `Remat()`), rewrites the step and ends
  the episode."""
  return name.split("(")[0] in ENDINGS


class DecisionPoint(NamedTuple):
  pattern: str                 # a glob that matches exactly `members`
  role: str                    # "param", "opt" or "data"
  members: tuple[int, ...]     # input value ids
  shape: tuple[int, ...]


class Action(NamedTuple):
  kind: str                    # one of TACTIC_KINDS
  tactic: Tactic | None        # None for finish
  point: int = -1              # decision point of a tile action
  dim: int = -1
  axis: str | None = None

  def __str__(self) -> str:
    return "Finish" if self.tactic is None else str(self.tactic)


def _layerless(path: str) -> str:
  """`gpt/layer_3/attn/w` -> `gpt/layer_*/attn/w`, `h/3/attn` -> `h/*/attn`: numbered module
  instances become one."""
  return "/".join(re.sub(r"(^|_)\d+$", r"\1*", seg) for seg in path.split("/"))


def _state_pattern(name: str, param: str) -> str:
  """The glob for an optimizer-state leaf and its kin in every layer: where its path leaves
  the parameter's, `/**/`, then the path they end with (`opt_state/**/gpt/layer_*/w`,
  `state/opt_state/**/transformer/h/*/attn/c_attn/kernel`)."""
  a, b = name.split("/"), param.split("/")
  tail = 0
  while tail < min(len(a), len(b)) - 1 and a[-1 - tail] == b[-1 - tail]:
    tail += 1
  head = 0
  while head < len(a) - tail - 1 and a[head] == b[head]:
    head += 1
  return "/".join(a[:head + 1]) + "/**/" + _layerless("/".join(a[len(a) - tail:]))


def decision_points(program: Program) -> list[DecisionPoint]:
  """The inputs with at least one dimension, grouped by role, layer-free path and shape."""
  roles = R.roles(program)
  role_of = {**{v: "param" for v in roles.weights}, **{v: "opt" for v in roles.opt_state},
             **{v: "data" for v in roles.data}}
  groups: dict[tuple, list[int]] = {}
  for vid, name in zip(program.inputs, program.input_names):
    v, role = program.values[vid], role_of.get(vid)
    if role is None or v.rank == 0 or v.size == 1:
      continue
    pattern = name
    if role == "opt":
      p = R.matching_param(program, vid)
      if p is not None:
        pattern = _state_pattern(name, program.name(p))
    else:
      pattern = _layerless(name)
    groups.setdefault((role, pattern, v.shape), []).append(vid)
  points = []
  for (role, pattern, shape), members in groups.items():
    if set(program.match(pattern)) == set(members):
      points.append(DecisionPoint(pattern, role, tuple(members), shape))
    else:  # the pattern would reach other inputs: one point per input, named exactly
      points.extend(DecisionPoint(program.name(m), role, (m,), shape) for m in members)
  return points


def manual_tactics(mesh: Mesh) -> list[tuple[str, Tactic]]:
  out = []
  for a in mesh.names:
    out += [("BatchParallel", BatchParallel(a)), ("Megatron", Megatron(a))]
    out += [("ZeRO", ZeRO(a, stage=s)) for s in (1, 2, 3)]
    out += [("EmbeddingSharding", EmbeddingSharding(a)), ("ExpertParallel", ExpertParallel(a)),
            ("SequenceParallel", SequenceParallel(a))]
  return out


class BatchCut(NamedTuple):
  """What cutting a program's batch depends on: the data inputs it splits and the batch
  size."""
  inputs: tuple[int, ...]
  size: int


def batch_cut(program: Program) -> BatchCut | None:
  """The program's batch as `Microbatch` cuts it; None where it cannot be cut as far as its
  dataflow tells (`partitioner.microbatch.cuttable`: no data input, a batch statistic, not
  traced from a function, cut or pipelined already)."""
  from partitioner.microbatch import batch_inputs, cuttable
  try:
    picked, n = batch_inputs(program, 1, "Microbatch")
  except ShardzeroError:
    return None
  k = next((k for k in MICROBATCHES if n % k == 0), None)
  if k is None or cuttable(program, k) is not None:
    return None
  return BatchCut(tuple(picked), n)


def microbatch_problem(cut: BatchCut | None, k: int) -> str | None:
  """Why cutting the batch into `k` micro-batches is not allowed (None if it is): each
  micro-batch must hold two examples or more (a step traced at one often traces differently:
  a squeezed dimension). Whether the plan so far replays on the cut step is not asked here: a
  tactic may mean something else there (`BatchParallel` over an axis the micro-batch does not
  divide over splits the sequence instead), and a plan that does not replay ends uncut."""
  if cut is None:
    return "the step's batch cannot be cut into micro-batches"
  if cut.size % k or cut.size // k < 2:
    return f"a batch of {cut.size} does not divide into {k} micro-batches of two or more"
  return None


def remat_problem(program: Program) -> str | None:
  """Why the step's activations cannot be recomputed (None if they can): what `Remat` refuses
  as written (`partitioner.remat.refusal`: a kept loop, `jax.checkpoint`), or no backward pass."""
  from partitioner.remat import refusal
  why = refusal(program)
  if why is None and not R.backward_ops(program):
    return "the step has no backward pass to recompute for"
  return why


def action_space(program: Program, mesh: Mesh, points: Sequence[DecisionPoint],
                 axes: Sequence[str] | None = None, cuts: bool = True) -> list[Action]:
  """Every action of a task over `axes` (default: all): the tiles that divide, the manual
  tactics that apply to the unpartitioned program (one that does not never will), with `cuts`
  the micro-batch counts that divide the batch (not for a sub-problem over some axes or from
  a partitioned start: it cannot rewrite the program it starts from) and the recomputation of
  the activations where it applies, and finish (last)."""
  sizes = mesh.sizes
  axes = mesh.names if axes is None else tuple(axes)
  actions = []
  for k, point in enumerate(points):
    for dim, n in enumerate(point.shape):
      for a in axes:
        if sizes[a] > 1 and n % sizes[a] == 0:
          actions.append(Action("tile", Tile(point.pattern, dim, a), k, dim, a))
  root = ShardingState(program, mesh)
  for kind, tactic in manual_tactics(mesh):
    if tactic.axis in axes and sizes[tactic.axis] > 1 and tactic_problem(tactic, root, 0) is None:
      actions.append(Action(kind, tactic, axis=tactic.axis))
  cut = batch_cut(program) if cuts and set(axes) == set(mesh.names) else None
  actions += [Action("Microbatch", Microbatch(k)) for k in MICROBATCHES
              if microbatch_problem(cut, k) is None]
  if cuts and set(axes) == set(mesh.names) and remat_problem(program) is None:
    actions.append(Action("Remat", Remat()))
  actions.append(Action("finish", None))
  return actions


def tile_problem(state: ShardingState, point: DecisionPoint, dim: int, axis: str) -> str | None:
  """Why tiling `dim` of a decision point over `axis` is not allowed now (None if it is): the
  partitioner's own check (`ShardingState.can_tile`) on each member and its updated outputs,
  which the tile tactic shards with it."""
  for m in point.members:
    for vid in (m,) + R.aliased_outputs(state.program, m):
      why = state.can_tile(vid, dim, (axis,))
      if why is not None:
        return why
  return None

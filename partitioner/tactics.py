"""Tactics: steps that tile chosen values over a mesh axis, then propagate.

Manual tactics (`Tile`, `Replicate`, `BatchParallel`, `Megatron`, `ZeRO`, `EmbeddingSharding`,
`ExpertParallel`, `SequenceParallel`) find their targets from the IR and value names, never
from model internals listed by hand. A schedule is a list of tactics applied in order; each
one refines what the earlier ones decided. Tactics that tile an input also tile the outputs
aliased to it (new params for params), so a training step maps its state to the same layout.
`Auto` hands mesh axes to a search agent or a trained policy inside the same schedule.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
import time
from typing import ClassVar, NamedTuple, Protocol, Sequence

from partitioner import roles as R
from partitioner.errors import PatternError, ScheduleError, ShardzeroError
from partitioner.partial_sums import accumulators
from partitioner.propagation import ShardingState


class Target(NamedTuple):
  name: str
  dim: int
  axes: tuple[str, ...]


class TacticReport(NamedTuple):
  tactic: str
  targets: tuple[Target, ...]
  visits: int                 # op visits of its propagation
  notes: tuple[str, ...] = ()
  propagate_s: float = 0.0    # time spent propagating


class TacticContext:
  """What a tactic works with: the program, the mesh, the state it refines, its position."""

  def __init__(self, state: ShardingState, index: int, dry_run: bool = False,
               schedule: Sequence["Tactic"] = (), solver: "AutoSolver | None" = None):
    self.state = state
    self.solver = solver      # what decides an `Auto` tactic (passed in by the caller)
    self.schedule = tuple(schedule)   # the tactics applied before this one
    self.dry_run = dry_run    # tile (and so check) the targets, but do not propagate
    self.program = state.program
    self.mesh = state.mesh
    self.index = index
    self.targets: list[Target] = []
    self.notes: list[str] = []
    self.visits = 0
    self.propagate_s = 0.0
    self._seeds: list[int] = []

  @property
  def roles(self) -> R.Roles:
    return R.roles(self.program)

  def tile(self, vid: int, dim: int, axes: Sequence[str] | str) -> bool:
    """Tiles a value (and its aliased outputs); the change propagates on `propagate()`."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    changed = False
    for v in (vid,) + R.aliased_outputs(self.program, vid):
      if self.state.tile(v, dim, axes, self.index):
        changed = True
        self._seeds.append(v)
    if changed:
      self.targets.append(Target(self.program.name(vid), dim % self.program.values[vid].rank, axes))
    return changed

  def propagate(self) -> None:
    """Propagates what was tiled since the last call, as its own priority phase."""
    if self._seeds and self.dry_run:
      self._seeds = []
    elif self._seeds:
      start = time.perf_counter()
      self.visits += self.state.propagate(self._seeds, self.index)
      self.propagate_s += time.perf_counter() - start
      self._seeds = []
      self.state.phase += 1

  def report(self, tactic: "Tactic") -> TacticReport:
    return TacticReport(str(tactic), tuple(self.targets), self.visits, tuple(self.notes),
                        self.propagate_s)


class Tactic(abc.ABC):
  """A partitioning step. Subclasses are frozen dataclasses; `str()` gives the schedule syntax."""

  name: ClassVar[str]

  @abc.abstractmethod
  def apply(self, ctx: TacticContext) -> None:
    """Tiles its targets in `ctx` and propagates."""

  def __str__(self) -> str:
    args = []
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.default is dataclasses.MISSING:
        args.append(str(v))
      elif v != f.default:
        args.append(f"{f.name}={v}")
    return f"{self.name}({', '.join(args)})"


class ProgramRewrite(Tactic):
  """A tactic that rewrites the program the other tactics shard (`Microbatch`): it comes
  first in a schedule (after other rewrites only: `HeadPadding(model); Microbatch(4)`), and
  `PartitionedProgram.apply` partitions what it returns."""

  @abc.abstractmethod
  def rewrite(self, program, mesh):
    """The rewritten program (for a schedule over `mesh`)."""

  def describe(self, program) -> str:
    """What the rewrite made of the program, for the tactic's report."""
    return repr(program)

  def shard(self, ctx: TacticContext) -> None:
    """Tiles what the rewritten program must have split (a pipeline's stages)."""

  def apply(self, ctx):
    raise ScheduleError(f"{self} rewrites the program the other tactics shard: put it first in "
                        f"the schedule (it came after {format_schedule(ctx.schedule)})")


TACTICS: dict[str, type[Tactic]] = {}


def register(cls):
  TACTICS[cls.name] = cls
  return cls


def _matches(ctx: TacticContext, pattern: str) -> list[int]:
  found = ctx.program.match(pattern)
  if not found:
    raise PatternError(f"pattern {pattern!r} matches no input or output of the program "
                       f"(inputs look like {ctx.program.input_names[0]!r})")
  return found


@register
@dataclasses.dataclass(frozen=True)
class Microbatch(ProgramRewrite):
  """Gradient accumulation: the step's batch cut into `k` micro-batches that run one after
  another in a loop; the loss and gradients are summed across them and the update is applied
  once (partitioner/microbatch.py). Activations shrink k-fold; nothing else changes."""
  k: int
  name: ClassVar[str] = "Microbatch"

  def rewrite(self, program, mesh):
    from partitioner.microbatch import microbatch
    return microbatch(program, self.k)

  def describe(self, program) -> str:
    return (f"the per-example part runs {self.k} times a step on 1/{self.k} of the batch; the "
            f"loss and gradients are summed, the update applied once")


@register
@dataclasses.dataclass(frozen=True)
class Pipeline(ProgramRewrite):
  """Pipeline parallelism: the layer stack cut into `stages` stages of consecutive layers (by
  default one per device of `axis`), that `microbatches` micro-batches (by default four per
  stage) stream through (partitioner/pipeline.py): in 1F1B's order (the whole per-example
  step in the pipeline; each stage keeps at most 2S-1 micro-batches' activations), GPipe's
  (the stack's forward for every micro-batch, then its backward; the rest of the step on the
  whole batch), or interleaved (1F1B with `virtual` chunks of layers a device, stage s holding
  chunks s, s+S, ...: the bubble is about 1/V of 1F1B's, for V times the hand-overs). Weights
  and optimizer state of a layer live on its stage only; activations cross stages in
  collective permutes; (S-1)/(M+S-1) of each stage's time is idle (1F1B, GPipe)."""
  axis: str
  stages: int = 0           # 0: the axis' size
  microbatches: int = 0     # 0: four per stage
  schedule: str = "1f1b"
  virtual: int = 0          # chunks a device under schedule=interleaved (0: 2; else 1)
  name: ClassVar[str] = "Pipeline"

  def sizes(self, mesh) -> tuple[int, int]:
    """(stages, micro-batches), the defaults resolved on `mesh`."""
    mesh.check_axis(self.axis)
    s = self.stages or mesh.size(self.axis)
    return s, self.microbatches or 4 * s

  def rewrite(self, program, mesh):
    from partitioner.pipeline import pipeline
    virtual = self.virtual or (2 if self.schedule == "interleaved" else 1)
    return pipeline(program, *self.sizes(mesh), self.schedule, virtual)

  def describe(self, program) -> str:
    s, m = program.stages, program.microbatches
    if self.schedule == "interleaved":
      v = self.virtual or 2
      return (f"{s} stages of {v} chunks of the layer stack (stage i holds chunks i, i+{s}, "
              f"...), {m} micro-batches streamed in interleaved 1F1B order, each stage keeping "
              f"at most {2 * v * s - 1} chunks' activations; {v * s - 1 + s - 1} of "
              f"{v * m + v * s + s - 2} iterations a chunk long are bubble")
    kept = f"at most {2 * s - 1}" if self.schedule == "1f1b" else f"all {m + s - 1}"
    return (f"{s} stages of the layer stack, {m} micro-batches streamed in {self.schedule} "
            f"order, each stage keeping {kept} micro-batches' activations; the bubble is "
            f"{s - 1}/{m + s - 1} of each stage's iterations")

  def shard(self, ctx):
    n = ctx.mesh.size(self.axis)
    if ctx.program.stages % n:
      raise ScheduleError(f"{self}: {ctx.program.stages} stages do not divide over "
                          f"{self.axis}={n}")
    for vid, dim in ctx.program.stage_values:
      ctx.tile(vid, dim, self.axis)
    ctx.propagate()


@register
@dataclasses.dataclass(frozen=True)
class HeadPadding(ProgramRewrite):
  """Attention heads padded to divide over `axis`: where an attention's heads do not divide by
  the axis' size (12 heads over 8 devices), its query, key, value and output projections are
  held with zero heads added up to a multiple of it (16), so that `Megatron(axis)` splits
  them rather than leaving the attention whole on every device, as GSPMD pads an uneven
  dimension (partitioner/heads.py). The zero heads add nothing to the results
  and cost their work, which the simulator prices. Nothing changes where the heads divide."""
  axis: str
  name: ClassVar[str] = "HeadPadding"

  def rewrite(self, program, mesh):
    from partitioner.heads import pad_heads
    mesh.check_axis(self.axis)
    from partitioner.remat import rematerialised
    if program.microbatches > 1 or program.head_multiple > 1 or rematerialised(program):
      raise ScheduleError(f"{self} pads the step as traced: put it before Microbatch, "
                          f"Pipeline and Remat, once")
    return pad_heads(program, mesh.size(self.axis))

  def describe(self, program) -> str:
    from partitioner.heads import padded_heads
    pairs, count = padded_heads(program)
    if not count:
      return (f"nothing padded: every attention's heads divide over {self.axis}, or none can "
              f"be padded (grouped key/value heads that do not divide, a scanned stack)")
    return ("attention heads padded with zero heads: " + ", ".join(
        f"{a} -> {b} (+{100 * (b / a - 1):.0f}% of the attention's work)"
        for a, b in sorted(pairs)) + f"; {count} inputs held padded")


@register
@dataclasses.dataclass(frozen=True)
class Remat(ProgramRewrite):
  """Activation recomputation: only the values at the narrowest cuts of the forward pass (the
  residual stream between layers) are kept for the backward pass, which computes each
  segment's activations again just before it needs them, as `jax.checkpoint` around every
  layer does (partitioner/remat.py). Activations shrink to the kept values and one segment's;
  the work grows by about one forward pass. Found from the dataflow in any straight-line step."""
  name: ClassVar[str] = "Remat"

  def rewrite(self, program, mesh):
    from partitioner.remat import remat
    return remat(program)

  def describe(self, program) -> str:
    r = program.recomputation
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    return (f"the forward pass cut into {len(r.bounds) + 1} segments; {r.segments} of them "
            f"({r.ops} ops) computed again before their backward pass: of the step's "
            f"activations ({gib(r.activation_bytes)} over the whole batch, unsplit), "
            f"{gib(r.recomputed_bytes)} recomputed, {gib(r.kept_bytes)} kept")


@register
@dataclasses.dataclass(frozen=True)
class StageScatter(Tactic):
  """Megatron-LM's scatter/gather of a pipeline's hand-overs: the activations crossing stages
  (and their gradients), and those a stage keeps for its backward pass, held split over `axis`
  along their features; a stage gathers them where its layers read them (`stage_view`, kept
  off `axis`), so the layers stay as the tactics before shard them. A hand-over then moves 1/n
  of its bytes over each device's own link, and a stage keeps 1/n of them. It comes after the
  tactics that shard the layers over `axis` (Megatron): applied before them, the split
  features would reach the weights first."""
  axis: str
  name: ClassVar[str] = "StageScatter"

  def apply(self, ctx):
    ctx.mesh.check_axis(self.axis)
    handed = ctx.program.handed
    if not handed:
      raise ScheduleError(f"{self}: the program is not pipelined (a Pipeline comes first in "
                          "the schedule)")
    n, dims, values = ctx.mesh.size(self.axis), ctx.state.dims, ctx.program.values
    # What the layers' tactics split over the axis already (attention by heads under
    # Megatron), and features that do not divide (a norm's statistics), stay as they are.
    split = [(v, d) for v, d in handed if values[v].shape[d] % n == 0 and
             not any(self.axis in axes for axes in dims[v])]
    if not split:
      raise ScheduleError(f"{self}: nothing a stage hands over or keeps has features that "
                          f"divide over {self.axis}={n} and are not split over it already")
    for op in ctx.program.ops:
      if op.name == "stage_view" and not any(self.axis in axes for axes in dims[op.outputs[0]]):
        ctx.state.forbid(op.outputs[0], (self.axis,), ctx.index)
    for vid, dim in split:
      ctx.tile(vid, dim, self.axis)
    ctx.propagate()


@register
@dataclasses.dataclass(frozen=True)
class Tile(Tactic):
  """Tiles dimension `dim` of every value matching `value` over mesh axis `axis`."""
  value: str
  dim: int
  axis: str
  name: ClassVar[str] = "Tile"

  def apply(self, ctx):
    ctx.mesh.check_axis(self.axis)
    for vid in _matches(ctx, self.value):
      ctx.tile(vid, self.dim, self.axis)
    ctx.propagate()


@register
@dataclasses.dataclass(frozen=True)
class Replicate(Tactic):
  """Keeps the matching values replicated over `axes` (all mesh axes if empty) from now on."""
  value: str
  axes: str = ""
  name: ClassVar[str] = "Replicate"

  def apply(self, ctx):
    axes = tuple(a for a in re.split(r"[+ ]", self.axes) if a) or ctx.mesh.names
    for vid in _matches(ctx, self.value):
      for v in (vid,) + R.aliased_outputs(ctx.program, vid):
        ctx.state.forbid(v, axes, ctx.index)
      ctx.targets.append(Target(ctx.program.name(vid), -1, ()))


@register
@dataclasses.dataclass(frozen=True)
class BatchParallel(Tactic):
  """Data parallelism: the batch inputs are split along `dim` over `axis`.

  The batch inputs are the data arguments (not params or optimizer state) sharing the most
  common leading size; `inputs` (a pattern) chooses them explicitly.
  """
  axis: str
  inputs: str = ""
  dim: int | None = None    # default: each input's batch dimension (`roles.batch_dim`)
  name: ClassVar[str] = "BatchParallel"

  def apply(self, ctx):
    ctx.mesh.check_axis(self.axis)
    if self.inputs:
      picked, rest = _matches(ctx, self.inputs), []
    else:
      picked, rest = R.batch_inputs(ctx.program, ctx.roles.data)
      if not picked:
        raise PatternError("BatchParallel found no data input (an argument other than params and "
                           "optimizer state); name one with inputs=PATTERN")
    for vid in picked:
      ctx.tile(vid, R.batch_dim(ctx.program, vid) if self.dim is None else self.dim, self.axis)
    for vid in rest:
      ctx.notes.append(f"left {ctx.program.name(vid)} unsplit: its batch size differs")
    if ctx.program.microbatches > 1 and self.dim is None and picked:
      self._note_short_microbatch(ctx, picked[0])
    ctx.propagate()

  def _note_short_microbatch(self, ctx, vid: int) -> None:
    """In a step cut into micro-batches, one micro-batch is what the devices split: where it
    holds fewer examples than they divide into, the devices it does not reach gather the
    micro-batch and repeat its work (a device's one example cannot be cut further), unless a
    later tactic gives the axis another dimension to split."""
    d = R.batch_dim(ctx.program, vid)
    axes = ctx.state.dims[vid][d]
    if self.axis not in axes:
      return
    size = ctx.program.values[vid].shape[d] // ctx.program.microbatches
    before = math.prod(ctx.mesh.size(a) for a in axes if a != self.axis)
    if size % before == 0 and size % (before * ctx.mesh.size(self.axis)):
      ctx.notes.append(
          f"a micro-batch of {size} examples does not split over {'+'.join(axes)} "
          f"({before * ctx.mesh.size(self.axis)} devices): the devices it does not reach over "
          f"{self.axis} gather it and repeat its work, unless a later tactic splits another "
          f"dimension over {self.axis} (fewer micro-batches avoid it)")


@register
@dataclasses.dataclass(frozen=True)
class Megatron(Tactic):
  """Tensor parallelism: MLPs split column-then-row, attention split by heads, an untied
  output head split by its vocabulary (or classes), over `axis`.

  The pairs are found structurally: a weight whose output dimension flows through pass-through
  ops into another weight's contracting dimension (see `roles.megatron_pairs`). A fused
  projection (HF GPT-2's `c_attn`: q, k and v from one matmul, then split) is held interleaved
  when traced (partitioner/layouts.py), so its kernel pairs like any other. Where it cannot be
  (inside a loop's body), it is split by heads at its chunks and its kernel stays replicated,
  since in the (chunk, head, head_dim) layout of its rows one device's heads are not a block.
  An output head (`roles.output_heads`: the softmax over its outputs is the loss's) is split
  by columns as Megatron-LM's output layer is: each device computes its share of the logits,
  and the softmax's maximum and sums, and the label's logit, are all-reduced per token. Left
  whole, every device of `axis` computed all the logits (HF Llama 1B at 64 H100s under
  dp+Megatron: 384 ms and 60 GiB, against 274 ms and 37 GiB split).
  """
  axis: str
  name: ClassVar[str] = "Megatron"

  def apply(self, ctx):
    m = ctx.mesh.size(self.axis)
    pairs = R.megatron_pairs(ctx.program, m)
    if not pairs:
      raise PatternError(f"Megatron({self.axis}) found no weight pairs to split by {m}")
    fused, nested = [], {}
    for pair in pairs:
      if pair.chunks:
        fused.append(ctx.program.name(pair.column))
        for vid, d in pair.chunks:
          ctx.tile(vid, d, self.axis)
      else:
        ctx.tile(pair.column, pair.column_dim, self.axis)
      for w, d in pair.rows:
        ctx.tile(w, d, self.axis)
      for w, d in ((pair.column, pair.column_dim),) * (not pair.chunks) + tuple(pair.rows):
        axes = ctx.state.dims[w][d]
        before = tuple(a for a in axes[:axes.index(self.axis)] if _by_zero(ctx, w, a)) \
            if self.axis in axes else ()
        if before:
          nested.setdefault(before, []).append(ctx.program.name(w))
    for before, names in nested.items():
      # ZeRO stage 3 before Megatron chose the dimension Megatron splits (unlike Megatron over
      # a first axis, `Megatron(batch); Megatron(model)`, which splits the heads both ways):
      # its split is the major one, so gathering it leaves no block of heads or columns per
      # device, and the activations between the pair may keep neither split (2.1x the FLOPs
      # per device on the corpus GPT, 3x on MaxText's 32B decoder without sequence
      # parallelism).
      ctx.notes.append(
          f"split over {self.axis} inside an earlier split over {', '.join(before)} along the "
          f"same dimension: the activations between the pair may not be split over "
          f"{self.axis} (each device computing more than its share); a ZeRO after Megatron "
          f"shards the dimension Megatron leaves whole: {', '.join(names[:4])}"
          + (" ..." if len(names) > 4 else ""))
    heads, whole = [], []
    for w, d in R.output_heads(ctx.program, m):
      if any(self.axis in dims for dims in ctx.state.dims[w]):
        continue
      size = ctx.program.values[w].shape[d]
      (whole if size % (m * _count(ctx.state, w, d)) else heads).append((w, d))
    for w, d in heads:
      ctx.tile(w, d, self.axis)
    if whole:
      ctx.notes.append(f"output heads left whole over {self.axis} (their classes, split "
                       f"already, do not divide by {m} more): "
                       + ", ".join(ctx.program.name(w) for w, _ in whole))
    if heads:
      ctx.notes.append(f"output heads split by columns over {self.axis} (each device's share "
                       "of the logits; the softmax's statistics all-reduced): "
                       + ", ".join(ctx.program.name(w) for w, _ in heads))
    if fused:
      names = sorted(set(fused))
      ctx.notes.append(
          f"fused projections split by heads after the split, kernel replicated over "
          f"{self.axis} (its rows hold each chunk's heads in turn, so no block of rows is one "
          f"device's heads): {', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
    ctx.propagate()
    state, fused_kernels = ctx.state, {p.column for p in pairs if p.chunks}
    left = [ctx.program.name(w) for w in R.matmul_weights(ctx.program)
            if w not in fused_kernels and not any(self.axis in d for d in state.dims[w])]
    if left:
      ctx.notes.append(
          f"matmul weights left whole over {self.axis} (no column/row pair whose heads or width "
          f"divide by {m}, nor an output head whose classes do: grouped k/v heads...): "
          f"{', '.join(left[:5])}"
          + (" ..." if len(left) > 5 else ""))


def _by_zero(ctx, vid: int, axis: str) -> bool:
  """Whether a ZeRO earlier in the schedule split `vid` over `axis` itself."""
  origin = ctx.state.origin.get((vid, axis))
  return (origin is not None and origin.op is None and origin.tactic < len(ctx.schedule)
          and isinstance(ctx.schedule[origin.tactic], ZeRO))


@register
@dataclasses.dataclass(frozen=True)
class EmbeddingSharding(Tactic):
  """Splits embedding tables (parameters read by a point-wise gather) along the looked-up
  (vocabulary) dimension: each device looks up its rows and the results are summed."""
  axis: str
  name: ClassVar[str] = "EmbeddingSharding"

  def apply(self, ctx):
    m = ctx.mesh.size(self.axis)
    tables = R.embedding_tables(ctx.program)
    if not tables:
      raise PatternError("EmbeddingSharding found no embedding lookup of a parameter")
    for vid, dim in tables:
      if any(self.axis in d for d in ctx.state.dims[vid]):
        ctx.notes.append(f"{ctx.program.name(vid)}: already sharded over {self.axis} by an "
                         "earlier tactic; left alone")
        continue
      if ctx.program.values[vid].shape[dim] % m:
        ctx.notes.append(f"{ctx.program.name(vid)}: {ctx.program.values[vid].shape[dim]} rows "
                         f"do not divide by {m}; left alone")
        continue
      ctx.tile(vid, dim, self.axis)
    ctx.propagate()


def _tile_exactly(ctx, tactic, axis, targets, what) -> None:
  """Tiles every (value, dim) over `axis`, or fails naming the first that does not divide;
  `what(size)` describes the dimension ("4 experts")."""
  m = ctx.mesh.size(axis)
  for vid, dim in targets:
    size = ctx.program.values[vid].shape[dim]
    split = _count(ctx.state, vid, dim)
    if size % (m * split):
      already = (f", split {split} ways over {'+'.join(ctx.state.dims[vid][dim])} already"
                 if split > 1 else "")
      raise ScheduleError(f"{tactic}: {ctx.program.name(vid)} has {what(size)}{already}, not "
                          f"divisible by {'a further ' if split > 1 else ''}{axis}={m}")
  for vid, dim in targets:
    ctx.tile(vid, dim, axis)
  ctx.propagate()


@register
@dataclasses.dataclass(frozen=True)
class ExpertParallel(Tactic):
  """Expert parallelism: weights with an expert dimension (a dimension a forward matmul treats
  as a batch dimension) are split along it over `axis`, and the tokens routed to an expert are
  processed where its weights are. Where the batch is split over the same axis, the tactic
  applied first wins at the expert matmuls, so it acts before the tactics that split the tokens
  over its axis wherever it is written (`PartitionedProgram.apply` replays them after it): the
  tokens move to their experts (GShard), where, applied after them, it would keep the tokens
  and gather every expert's weights."""
  axis: str
  name: ClassVar[str] = "ExpertParallel"

  def apply(self, ctx):
    weights = R.expert_weights(ctx.program)
    if not weights:
      raise PatternError("ExpertParallel found no expert weights (a parameter dimension that "
                         "a matmul treats as a batch dimension)")
    _tile_exactly(ctx, self, self.axis, weights, lambda n: f"{n} experts")


@register
@dataclasses.dataclass(frozen=True)
class SequenceParallel(Tactic):
  """Sequence (context) parallelism: the batch inputs are split along their sequence
  dimension `dim` over `axis`; attention gathers the keys and values it needs."""
  axis: str
  dim: int = 1
  inputs: str = ""
  name: ClassVar[str] = "SequenceParallel"

  def apply(self, ctx):
    picked = _matches(ctx, self.inputs) if self.inputs else R.batch_inputs(
        ctx.program, ctx.roles.data)[0]
    picked = [v for v in picked if ctx.program.values[v].rank > self.dim]
    if not picked:
      raise PatternError(f"SequenceParallel found no data input with a dimension {self.dim}")
    _tile_exactly(ctx, self, self.axis, [(v, self.dim) for v in picked],
                  lambda n: f"length {n} along dim {self.dim}")


# A loop that adds partial sums to a carry no larger than this (a recurrence's decay gradient,
# summed over time steps) keeps it whole under ZeRO and reduces it after the loop.
ACCUMULATOR_BYTES = 4 << 20


@register
@dataclasses.dataclass(frozen=True)
class ZeRO(Tactic):
  """ZeRO over a data-parallel axis: stage 1 shards the optimizer state, 2 also the gradients,
  3 also the parameters (FSDP).

  ZeRO is data parallelism with sharded state, so the batch is split over `axis` first if no
  earlier tactic did. Each parameter's state is cut along one dimension that divides (the
  largest one not already sharded). Stage 1 keeps everything the optimizer state does not feed
  (forward, backward, gradients) and the parameters replicated over `axis`; stage 2 keeps only
  the parameters replicated. Stages 2 and 3 keep a loop's small partial-sum accumulators whole
  (see `ACCUMULATOR_BYTES`).
  """
  axis: str
  stage: int = 3
  name: ClassVar[str] = "ZeRO"

  def apply(self, ctx):
    if self.stage not in (1, 2, 3):
      raise ScheduleError(f"ZeRO stage must be 1, 2 or 3, got {self.stage}")
    m = ctx.mesh.size(self.axis)
    program, state = ctx.program, ctx.state
    roles = ctx.roles
    if not roles.opt_state and self.stage < 3:
      raise PatternError("ZeRO found no optimizer state (an argument named like opt_state)")
    batch, _ = R.batch_inputs(program, roles.data)
    if batch and not any(self.axis in d for v in batch for d in state.dims[v]):
      for vid in batch:
        d = R.batch_dim(program, vid)
        if program.values[vid].shape[d] % (m * _count(state, vid, d)) == 0:
          ctx.tile(vid, d, self.axis)
      ctx.propagate()

    layer_dim = R.stacked_dims(program)

    def choose_dim(vid):
      v = program.values[vid]
      dims = state.dims[vid]
      options = [d for d in range(v.rank) if v.shape[d] % (m * _count(state, vid, d)) == 0
                 and self.axis not in dims[d] and d != layer_dim.get(vid)]
      if any(self.axis in d for d in dims) or not options:
        return None
      return max(options, key=lambda d: (not dims[d], v.shape[d], -d))

    chosen: dict[int, int | None] = {}
    if self.stage == 3:
      for p in roles.params:
        chosen[p] = choose_dim(p)
        if chosen[p] is not None:
          ctx.tile(p, chosen[p], self.axis)
    for o in roles.opt_state:
      if program.values[o].rank == 0:
        continue
      p = R.matching_param(program, o)
      if p is not None and p not in chosen:
        chosen[p] = choose_dim(p)
      d = chosen.get(p) if p is not None else choose_dim(o)
      if d is not None and program.values[o].shape[d] % (m * _count(state, o, d)):
        d = choose_dim(o)  # an earlier tactic sharded this state differently from its param
      if d is not None and not any(self.axis in dd for dd in state.dims[o]):
        ctx.tile(o, d, self.axis)
    skipped = [program.name(p) for p, d in chosen.items() if d is None]
    if skipped:
      ctx.notes.append(f"not sharded over {self.axis} (no free dimension divides by {m}, or "
                       f"already sharded on it): {', '.join(skipped[:5])}"
                       + (" ..." if len(skipped) > 5 else ""))
    if self.stage < 3:
      for p in roles.params:
        for v in (p,) + R.aliased_outputs(program, p):
          if not any(self.axis in d for d in state.dims[v]):
            state.forbid(v, (self.axis,), ctx.index)
    if self.stage > 1:
      for accumulator in accumulators(state, ACCUMULATOR_BYTES):
        if not any(self.axis in d for v in accumulator for d in state.dims[v]):
          for v in accumulator:
            state.forbid(v, (self.axis,), ctx.index)
    if self.stage == 1:
      fed = R.depends_on(program, tuple(roles.opt_state))
      for v in range(len(program.values)):
        if v not in fed and not any(self.axis in d for d in state.dims[v]):
          state.forbidden[v] = state.forbidden.get(v, frozenset()) | {self.axis}
    ctx.propagate()


class AutoRequest(NamedTuple):
  """What an automatic tactic hands to its solver: the state so far and what it may decide."""
  tactic: "Auto"
  state: ShardingState             # a copy of the state so far; the solver may not change it
  schedule: tuple                  # the tactics applied before
  axes: tuple[str, ...]            # the mesh axes the solver may shard over


class AutoSolver(Protocol):
  """Decides an `Auto` tactic: the tactics to apply for `request`, or a `ScheduleError` for an
  agent it does not know. Solvers play agents in the environment, above the partitioner, so
  the caller passes one in: `agents.search.auto.solve` (search agents) or `launch.auto.solve`
  (also trained policies)."""

  def __call__(self, request: AutoRequest) -> Sequence[Tactic]:
    ...


@register
@dataclasses.dataclass(frozen=True)
class Auto(Tactic):
  """Hands mesh axes (`"model"`, `"batch+model"`, empty for all) to a search agent or a
  trained policy, which picks tactics over those axes starting from what the schedule decided
  so far, scored by the simulator on `hardware` with `memory` bytes per device (default: the
  device's). `policy` is a `shardzero train` run directory; `agent` is greedy, beam, mcts,
  random or ilp (`budget` seconds) without one, greedy (decoding) or mcts (policy-guided)
  with one. The report lists
  the tactics chosen; the same schedule chooses the same ones again."""
  axes: str = ""
  policy: str = ""
  agent: str = "greedy"
  budget: int = 50
  hardware: str = "h100"
  memory: str = ""
  max_steps: int = 0
  name: ClassVar[str] = "Auto"

  def apply(self, ctx):
    axes = tuple(a for a in re.split(r"[+ ]", self.axes) if a) or ctx.mesh.names
    for a in axes:
      ctx.mesh.check_axis(a)
    if ctx.solver is None:
      raise ScheduleError(f"{self} needs a solver: pass solver=agents.search.auto.solve (search "
                          "agents) or launch.auto.solve (also policies) to apply()")
    if ctx.dry_run:
      return
    chosen = list(ctx.solver(AutoRequest(self, ctx.state.copy(), ctx.schedule, axes)))
    for tactic in chosen:
      if isinstance(tactic, Auto):
        raise ScheduleError("Auto: a solver returned another Auto tactic")
      tactic.apply(ctx)
    ctx.notes.append("chose: " + (format_schedule(chosen) or "nothing"))


def _count(state, vid, dim) -> int:
  n = 1
  for a in state.dims[vid][dim]:
    n *= state.sizes[a]
  return n


# ------------------------------------------------------------------------------- legality
def tactic_problem(tactic: Tactic, state: ShardingState, index: int) -> str | None:
  """Why `tactic` cannot be applied to `state` as tactic number `index` (None if it can): a
  dry run that tiles its targets on a scratch copy without propagating. Every tactic but ZeRO
  tiles all its targets before it propagates, so the dry run fails exactly where applying it
  would; ZeRO chooses its dimensions after propagating the batch, and never fails once it
  applies to the program at all, so the environment only keeps it from being applied twice
  over one axis."""
  ctx = TacticContext(state.scratch(), index, dry_run=True)
  try:
    tactic.apply(ctx)
  except ShardzeroError as e:
    return str(e)
  if not ctx.targets:
    return "it changes nothing here"
  return None


def tactic_footprint(tactic: Tactic, program, mesh) -> frozenset[int]:
  """The values a manual tactic other than ZeRO tiles on the unpartitioned program. Its
  targets depend on the program and mesh alone, so its dry run on any state reads the
  shardings and forbidden axes of these values only: its legality can change only when one of
  them does."""
  state = ShardingState(program, mesh)
  state.changed.clear()
  tactic.apply(TacticContext(state, 0, dry_run=True))
  return frozenset(state.changed)


# ------------------------------------------------------------------------------ schedule syntax
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.S)


def _split_args(text: str) -> list[str]:
  parts, depth, cur, quote = [], 0, [], None
  for ch in text:
    if quote:
      cur.append(ch)
      if ch == quote:
        quote = None
    elif ch in "'\"":
      quote = ch
      cur.append(ch)
    elif ch in "([{":
      depth += 1
      cur.append(ch)
    elif ch in ")]}":
      depth -= 1
      cur.append(ch)
    elif ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return [p.strip() for p in parts]


def _value(text: str):
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    return text[1:-1]
  if re.fullmatch(r"-?\d+", text):
    return int(text)
  if text in ("True", "true"):
    return True
  if text in ("False", "false"):
    return False
  return text


def parse_tactic(text: str) -> Tactic:
  m = _CALL.match(text)
  if not m:
    raise ScheduleError(f"cannot parse tactic {text.strip()!r}; expected Name(arg, key=value)")
  name, args_text = m.group(1), m.group(2) or ""
  cls = TACTICS.get(name)
  if cls is None:
    raise ScheduleError(f"unknown tactic {name!r}; known: {', '.join(sorted(TACTICS))}")
  args, kwargs = [], {}
  for part in _split_args(args_text):
    key, eq, val = part.partition("=")
    if eq and re.fullmatch(r"[A-Za-z_]\w*", key.strip()):
      kwargs[key.strip()] = _value(val.strip())
    else:
      args.append(_value(part))
  try:
    return cls(*args, **kwargs)
  except TypeError as e:
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    raise ScheduleError(f"bad arguments for {name}({fields}): {e}") from None


def parse_schedule(text: str) -> list[Tactic]:
  """`"BatchParallel(batch); Megatron(model); ZeRO(batch, stage=3)"` -> tactics."""
  items = [s for s in re.split(r"[;\n]", text) if s.strip()]
  return [parse_tactic(s) for s in items]


def format_schedule(tactics: Sequence[Tactic]) -> str:
  return "; ".join(str(t) for t in tactics)

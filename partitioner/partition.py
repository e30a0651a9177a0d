"""Applying a tactic schedule to a program: the partitioned program and what it decided."""

from __future__ import annotations

import collections
import functools
import time
import weakref
from typing import Mapping, Sequence

from partitioner.collectives import Collective, summarize
from partitioner.ir import Program
from partitioner.mesh import Mesh
from partitioner.plan import Plan, make_plan
from partitioner.propagation import Conflict, ShardingState
from partitioner.sharding import Sharding, spec_entries
from partitioner.tactics import (AutoSolver, BatchParallel, ExpertParallel, ProgramRewrite,
                                 SequenceParallel, Tactic, TacticContext, TacticReport, Tile,
                                 ZeRO, format_schedule, parse_schedule)


def _acts_before(tactic: Tactic, done: Sequence[Tactic], program: Program) -> int | None:
  """Where in `done` (the tactics applied to `program`) `tactic` acts, if not after them:
  `ExpertParallel` before the first tactic that split the tokens over its axis
  (`BatchParallel`, `SequenceParallel`, `ZeRO`, a `Tile` of a data input), so that the tokens
  move to their experts whichever was written first (applied after, it would meet tokens split
  over its axis at the expert matmuls and gather every expert's weights instead)."""
  if not isinstance(tactic, ExpertParallel):
    return None
  from partitioner.roles import roles
  data = None
  for k, t in enumerate(done):
    if getattr(t, "axis", None) != tactic.axis:
      continue
    if isinstance(t, (BatchParallel, SequenceParallel, ZeRO)):
      return k
    if isinstance(t, Tile):
      data = frozenset(roles(program).data) if data is None else data
      if not data.isdisjoint(program.match(t.value)):
        return k
  return None


REWRITES_KEPT = 4
_rewrites: collections.OrderedDict = collections.OrderedDict()


def rewrite_kept(program: Program, tactic: ProgramRewrite, mesh: Mesh) -> Program:
  """`tactic.rewrite(program, mesh)`, the last `REWRITES_KEPT` of them kept for the process:
  a proposal tries one rewrite under several plans (HF Llama 7B at 64 H100s: the step cut into
  4 micro-batches twice and recomputed four times; kept, `propose`'s 22.5 s took 19.6). Rewrites
  are pure (of the program and the function it was traced from); a few are kept, not one per
  program, as a rewritten 7B step is as large as the step."""
  source = getattr(program, "source", None)   # what a rewrite traces again
  key = (id(program), id(source), tactic, mesh)
  kept = _rewrites.get(key)
  if kept is not None and kept[0] is program and kept[2] is source:
    _rewrites.move_to_end(key)
    return kept[1]
  out = tactic.rewrite(program, mesh)
  _rewrites[key] = (program, out, source)
  while len(_rewrites) > REWRITES_KEPT:
    _rewrites.popitem(last=False)
  return out


def _as_decided(tactic: Tactic, report: TacticReport) -> str:
  """A tactic as the schedule text that replays it: an `Auto` as what it chose ("" for
  nothing), any other as itself."""
  chose = [n[len("chose: "):] for n in report.notes if n.startswith("chose: ")]
  if not chose:
    return str(tactic)
  return "" if chose[0] == "nothing" else chose[0]


def as_mesh(mesh: Mesh | str | Mapping[str, int]) -> Mesh:
  if isinstance(mesh, Mesh):
    return mesh
  return Mesh.parse(mesh) if isinstance(mesh, str) else Mesh(mesh)


def as_tactics(schedule: str | Tactic | Sequence[Tactic]) -> list[Tactic]:
  if isinstance(schedule, str):
    return parse_schedule(schedule)
  if isinstance(schedule, Tactic):
    return [schedule]
  return list(schedule)


class PartitionedProgram:
  """A program, a mesh, and the shardings a schedule of tactics chose. Immutable: `apply`
  returns a new one, so a search can branch from any point. While the program it was applied
  to is alive, what is derived from it (the plan, costs) is updated rather than recomputed."""

  def __init__(self, program: Program, mesh: Mesh, state: ShardingState | None = None,
               schedule: Sequence[Tactic] = (), reports: Sequence[TacticReport] = (),
               parent: "PartitionedProgram | None" = None):
    self.program = program
    self.mesh = mesh
    self.state = state if state is not None else ShardingState(program, mesh)
    self.schedule = tuple(schedule)
    self.reports = tuple(reports)
    self._parent = weakref.ref(parent) if parent is not None else None
    self.derived: dict = {}   # caches of what is computed from the shardings (cost model)

  @property
  def parent(self) -> "PartitionedProgram | None":
    """The program this one was applied to, if it is still alive; `state.changed` says which
    values differ from it."""
    return self._parent() if self._parent is not None else None

  def apply(self, schedule: str | Tactic | Sequence[Tactic],
            solver: AutoSolver | None = None) -> "PartitionedProgram":
    """The schedule's tactics applied after this program's; `solver` decides `Auto` tactics."""
    tactics = as_tactics(schedule)
    rewritten = all(isinstance(t, ProgramRewrite) for t in self.schedule)
    if tactics and isinstance(tactics[0], ProgramRewrite) and rewritten:
      # Rewrites come first, one after another (`HeadPadding(model); Microbatch(4)`).
      start = time.perf_counter()
      program = rewrite_kept(self.program, tactics[0], self.mesh)
      state = ShardingState(program, self.mesh)
      ctx = TacticContext(state, len(self.schedule), solver=solver)
      tactics[0].shard(ctx)
      report = TacticReport(str(tactics[0]), tuple(ctx.targets), ctx.visits,
                            (tactics[0].describe(program),) + tuple(ctx.notes),
                            time.perf_counter() - start)
      return PartitionedProgram(program, self.mesh, state,
                                schedule=self.schedule + tuple(tactics[:1]),
                                reports=self.reports + (report,)).apply(tactics[1:], solver)
    state = self.state.copy()
    done, reports = list(self.schedule), list(self.reports)
    for i, tactic in enumerate(tactics):
      k = _acts_before(tactic, done, self.program)
      if k is not None:
        return self._replayed(done, reports, k, tactic, list(tactics[i + 1:]), solver)
      ctx = TacticContext(state, len(done), schedule=done, solver=solver)
      tactic.apply(ctx)
      done.append(tactic)
      reports.append(ctx.report(tactic))
    return PartitionedProgram(self.program, self.mesh, state, done, reports, parent=self)

  def _replayed(self, done: list[Tactic], reports: list[TacticReport], k: int, tactic: Tactic,
                rest: list[Tactic], solver: AutoSolver | None) -> "PartitionedProgram":
    """The tactics `done` (with their `reports`) applied again to this program's rewritten
    program with `tactic` at position `k` (where it acts, `_acts_before`), then `rest`; an
    `Auto` already applied replays what it chose."""
    order = [[t] if (d := _as_decided(t, r)) == str(t) else parse_schedule(d)
             for t, r in zip(done, reports)]
    order = order[:k] + [[tactic]] + order[k:]
    rewrites = [t for t in done if isinstance(t, ProgramRewrite)]
    state = ShardingState(self.program, self.mesh)
    if rewrites:   # the rewritten program, with what its last rewrite split (a pipeline's stages)
      rewrites[-1].shard(TacticContext(state, len(rewrites) - 1, solver=solver))
    base = PartitionedProgram(self.program, self.mesh, state, schedule=rewrites,
                              reports=reports[:len(rewrites)])
    out = base.apply([t for ts in order[len(rewrites):] for t in ts], solver)
    moved = out.schedule.index(tactic)
    report = out.reports[moved]
    note = f"acts before {done[k]}, so that the tokens move to their experts (written after it)"
    out.reports = out.reports[:moved] + (report._replace(notes=report.notes + (note,)),) + \
        out.reports[moved + 1:]
    out = out.apply(rest, solver)
    # A new lineage: any value may differ from this state's (`apply` copies the state, which
    # starts a fresh `changed`, so this is set last: the environment's masks read it).
    out.state.changed = set(range(len(self.program.values)))
    return out

  # --------------------------------------------------------------------------- results
  @functools.cached_property
  def plan(self) -> Plan:
    parent = self.parent
    if parent is not None and "plan" in parent.__dict__:
      return make_plan(self.state, parent.plan)
    return make_plan(self.state)

  @property
  def collectives(self) -> list[Collective]:
    return self.plan.collectives

  @property
  def conflicts(self) -> list[Conflict]:
    return self.state.conflicts

  @functools.cached_property
  def fallbacks(self) -> dict[int, str]:
    """Ops that run replicated for want of a rule: op index -> reason."""
    return dict(sorted(self.state.table.all_fallbacks().items()))

  @property
  def strategy(self) -> str:
    return format_schedule(self.schedule)

  @property
  def decided(self) -> str:
    """The schedule with each `Auto` written as the tactics it chose: the same plan, which
    replays without a solver."""
    return "; ".join(filter(None, (_as_decided(t, r)
                                   for t, r in zip(self.schedule, self.reports))))

  def sharding(self, name: str) -> Sharding:
    return self.state.sharding(self.program.value(name).id)

  def input_shardings(self) -> dict[str, Sharding]:
    return {n: self.state.sharding(v) for v, n in zip(self.program.inputs, self.program.input_names)}

  def output_shardings(self) -> dict[str, Sharding]:
    return {n: self.state.sharding(v)
            for v, n in zip(self.program.outputs, self.program.output_names)}

  def why(self, name: str) -> list[str]:
    """Which tactic and op gave each axis of a value."""
    return self.state.why(self.program.value(name).id)

  def lower_spmd(self, jax_mesh=None):
    from partitioner.lowering import lower_spmd
    return lower_spmd(self, jax_mesh)

  def jit(self, jax_mesh=None, donate: bool = False):
    from partitioner.lowering import jit_partitioned
    return jit_partitioned(self, jax_mesh, donate)

  def summary(self) -> dict:
    """A JSON-ready description: strategy, shardings, collectives, fallbacks, conflicts."""
    p = self.program
    spec = lambda dims: [list(e) if isinstance(e, tuple) else e for e in spec_entries(dims)]
    return {
        "strategy": self.strategy,
        "mesh": dict(self.mesh.axes),
        "shardings": {n: spec(self.state.dims[v]) for v, n in zip(p.inputs, p.input_names)},
        "output_shardings": {n: spec(self.state.dims[v])
                             for v, n in zip(p.outputs, p.output_names)},
        "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes,
                         "value": p.name(c.value), "op": c.op,
                         **({"reduce": c.reduce} if c.kind == "all-reduce" else {})}
                        for c in self.collectives],
        "collective_summary": summarize(self.collectives),
        "loops": list(p.loops),
        "layouts": {p.input_names[k]: str(lay) for k, lay in p.layouts.items()},
        "fallbacks": [{"op": i, "primitive": p.ops[i].name, "reason": r}
                      for i, r in self.fallbacks.items()],
        "conflicts": [c._asdict() for c in self.conflicts],
        "tactics": [{"tactic": r.tactic, "targets": [list(t) for t in r.targets],
                     "notes": list(r.notes)} for r in self.reports],
    }

  def __repr__(self) -> str:
    return f"PartitionedProgram({self.program!r}, mesh={self.mesh}, strategy={self.strategy!r})"


def apply(program: Program, mesh: Mesh | str | Mapping[str, int],
          schedule: str | Tactic | Sequence[Tactic] = (),
          solver: AutoSolver | None = None) -> PartitionedProgram:
  """Partitions `program` over `mesh` with a schedule of tactics (objects or a string);
  `solver` decides its `Auto` tactics (`agents.search.auto.solve`, `launch.auto.solve`)."""
  return PartitionedProgram(program, as_mesh(mesh)).apply(schedule, solver)

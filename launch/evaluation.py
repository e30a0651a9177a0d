"""Agents evaluated on tasks: what `shardzero evaluate` runs, stores and summarises.

A task is (model, mesh, hardware, memory budget). Each (agent, task) result is kept in a
results store (JSON lines, one per result, appended as it arrives) under the agent's version,
so a re-run only evaluates what is missing and the best-known strategy of a task (the fastest
that fits over every agent ever evaluated on it, experts included) only improves. Corpus
models always get the `expert` agent, so every ratio has an expert in its denominator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import types
from typing import Iterable, NamedTuple

from partitioner.errors import ShardzeroError

# Bump an agent's version when what it decides changes: its stored results are then redone.
AGENT_VERSIONS = {"expert": 11, "random": 2, "greedy": 5, "beam": 5, "mcts": 5, "ilp": 11,
                  "policy": 7, "policy+mcts": 7, "policy+guard": 13, "policy+mcts+guard": 13}
DEFAULT_NUMBER = {"mcts": 100, "ilp": 60, "policy+mcts": 16, "policy+mcts+guard": 16,
                  "beam": 200}
WITHIN = 1.10       # "within 10% of the best known"


class AgentSpec(NamedTuple):
  """`mcts:64`, `ilp:30` (a time limit in seconds), `policy:runs/demo`,
  `policy+mcts:runs/demo:16`; `policy+guard:RUN` and `policy+mcts+guard:RUN:16` are those
  checked against the hand schedules and cut into micro-batches where that fits a faster plan,
  as `propose` answers (`agents.guard`)."""
  kind: str
  run: str | None = None       # a policy's run directory
  number: int | None = None    # simulations (mcts, policy+mcts), steps (beam), seconds (ilp)

  def __str__(self) -> str:
    parts = [self.kind] + ([self.run] if self.run else []) + (
        [str(self.number)] if self.number is not None else [])
    return ":".join(parts)


def parse_agent(text: str) -> AgentSpec:
  kind, _, rest = text.strip().partition(":")
  if kind not in AGENT_VERSIONS:
    raise ShardzeroError(f"unknown agent {text!r}; agents: expert, random, greedy, beam[:STEPS], "
                         "mcts[:SIMS], ilp[:SECONDS], policy:RUN, policy+mcts:RUN[:SIMS], "
                         "policy+guard:RUN, policy+mcts+guard:RUN[:SIMS]")
  run, number = None, DEFAULT_NUMBER.get(kind)
  if kind.startswith("policy"):
    head, sep, tail = rest.rpartition(":")
    if kind.startswith("policy+mcts") and sep and tail.isdigit():
      rest, number = head, int(tail)
    if not rest:
      raise ShardzeroError(f"agent {text!r} needs a run directory: {kind}:RUN")
    run = rest
  elif rest:
    if not rest.isdigit() or int(rest) < 1 or number is None:
      raise ShardzeroError(f"agent {text!r}: {kind} takes "
                           + ("no argument" if number is None else "a positive integer"))
    number = int(rest)
  return AgentSpec(kind, run, number)


def _cost_model_version() -> int:
  from partitioner.cost import COST_MODEL_VERSION
  return COST_MODEL_VERSION


def costed_now(version: str) -> bool:
  """Whether a stored result's version (`mcts-v1-c2`, `policy-v2-c2-<digest>`) is of the
  current cost model."""
  parts = version.split("-")
  return len(parts) > 2 and parts[2] == f"c{_cost_model_version()}"


def agent_version(spec: AgentSpec) -> str:
  """The agent's version and the cost model's; for a policy also a digest of its checkpoint,
  so that a retrained policy is evaluated again."""
  version = f"{spec.kind}-v{AGENT_VERSIONS[spec.kind]}-c{_cost_model_version()}"
  if spec.run is None:
    return version
  from learners.checkpointing import CheckpointError, path_of
  try:
    path = path_of(spec.run)
  except CheckpointError as e:
    raise ShardzeroError(f"agent {spec}: {e}") from None
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return f"{version}-{digest.hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class EvalTask:
  """`budget`: "device" (the device's memory), bytes ("16GiB"), or a fraction in (0, 1] of the
  way from the smallest expert peak to the data-parallel peak, as the environment's tight
  budgets."""
  model: str
  mesh: str
  hardware: str = "h100"
  budget: str = "device"

  @property
  def key(self) -> str:
    return f"{self.model} | {self.mesh} | {self.hardware} | {self.budget}"

  @property
  def devices(self) -> int:
    from partitioner.mesh import Mesh
    return Mesh.parse(self.mesh).device_count

  def resolve(self):
    """The environment's `Task`, with the budget in bytes."""
    from environments import Task
    from environments.tasks import tight_budget
    task = Task(self.model, self.mesh, self.hardware)
    budget = parse_budget(self.budget)
    if isinstance(budget, float):
      budget = tight_budget(task, budget)
    return dataclasses.replace(task, memory_budget=budget)


def parse_budget(text: str) -> int | float | None:
  """None for "device", a float for a tight fraction in (0, 1], else bytes; bad ones are a
  `WorkloadError`."""
  from environments import parse_bytes
  text = str(text).strip()
  if text == "device":
    return None
  try:
    fraction = float(text)
  except ValueError:
    return parse_bytes(text)
  return fraction if 0 < fraction <= 1 else parse_bytes(text)


def check_budget(text: str) -> str:
  """A memory budget as tasks take it (checked)."""
  parse_budget(text)
  return str(text).strip()


def expand_models(names: Iterable[str], preset: str) -> list[str]:
  """Corpus names, family names (at `preset`), split names (their families at `preset`) and
  user `module:function`s; unknown ones are a one-line `WorkloadError`."""
  import corpus
  from corpus.registry import check_name
  out = []
  for name in (n.strip() for n in names):
    if name in corpus.SPLITS:
      out += [f"{f}:{preset}" for f in corpus.split(name)]
    elif name in corpus.FAMILIES:
      out.append(f"{name}:{preset}")
    else:
      check_name(name)
      out.append(name)
  return out


# ---------------------------------------------------------------------------------- running
def _run_agent(spec: AgentSpec, env, seed: int) -> dict:
  """Plays one episode of `spec` in `env` (reset); what it decided and how long it took."""
  from agents.environment_loop import EnvironmentLoop
  from agents.loggers import InMemoryLogger
  extra: dict = {}
  if spec.kind.startswith("policy"):
    from launch.runtime import collector_paused
    with collector_paused():   # as `propose` decides
      return _run_policy(spec, env)
  from launch.search_command import make_actor
  if spec.kind == "ilp":
    from agents.search.ilp import ILPActor
    actor = ILPActor(env, time_limit_s=float(spec.number))
  else:
    args = types.SimpleNamespace(budget=spec.number or 1, width=4, seed=seed)
    actor = make_actor(spec.kind, env, args)
  start = time.perf_counter()
  EnvironmentLoop(env, actor, logger=InMemoryLogger(), should_update=False).run_episode()
  seconds = time.perf_counter() - start
  if spec.kind in PIPELINED_AGENTS:
    start = time.perf_counter()
    staged = pipelined_plan(spec, env, float(spec.number or 0))
    seconds += time.perf_counter() - start
    if staged is not None:
      extra["pipelined"] = staged
  if spec.kind in PIPELINED_AGENTS:
    start = time.perf_counter()
    padded = heads_padded_plan(spec, env, extra.get("pipelined"), float(spec.number or 0))
    seconds += time.perf_counter() - start
    if padded is not None:
      extra["heads_padded"] = padded
  if spec.kind == "ilp":
    s = actor.solution
    extra = {**extra, "ilp": {"objective_s": s.objective_s, "simulated_s": s.simulated_s,
                     "linearisation_error": s.simulated_s / s.objective_s - 1
                     if s.objective_s else 0.0,
                     "status": s.status, "gap": s.gap, "variables": s.variables,
                     "constraints": s.constraints, "rounds": s.rounds,
                     "enumerated": s.enumerated,
                     "skipped": len(s.skipped),
                     "build_s": s.build_s, "solve_s": s.solve_s}}
  simulations = getattr(actor, "simulations", len(env.history))
  return {"decide_s": seconds, "simulations": simulations, **extra}


def _run_policy(spec: AgentSpec, env) -> dict:
  """A trained policy's episode (raw, policy-guided MCTS, or guarded as `propose` answers)."""
  policy = _policy(spec.run)
  search = "mcts" if spec.kind.startswith("policy+mcts") else "greedy"
  if spec.kind.endswith("+guard"):
    from agents.guard import fit_with_microbatches, play_guarded
    from launch.auto import solve
    g = play_guarded(env, policy, search, spec.number or 1)
    start = time.perf_counter()
    decide, per_stage = pipeline_decider(spec, env.context)
    micro = fit_with_microbatches(env.context, g, decide=decide, solver=solve,
                                  per_stage=per_stage)
    out = {"decide_s": g.policy_s + g.guard_s + time.perf_counter() - start,
           "simulations": g.simulations,
           "guard": {"winner": g.winner, "policy_step_time_s": g.policy_step_s,
                     "policy_peak_memory_bytes": g.policy_peak_bytes,
                     "policy_fits": g.policy_fits, "policy_s": g.policy_s,
                     "guard_s": g.guard_s}}
    if micro is not None:   # as `propose` answers: a plan that fits once its batch is cut
      out["microbatched"] = {"k": micro.k, "base": micro.base, "schedule": micro.pp.decided,
                             "step_time_s": micro.cost.step_time_s,
                             "peak_memory_bytes": micro.cost.peak_memory_bytes}
    return out
  from agents.decoding import play_policy
  seconds, simulations = play_policy(env, policy, search, spec.number or 1)
  return {"decide_s": seconds, "simulations": simulations}


# Agents whose plan is checked against pipelines after their episode (`agents.pipelines`): the
# search agents each deciding the other axes of the pipelined program itself, the expert with
# the pipelining hand schedules; the guarded policies meet them in
# `agents.guard.fit_with_microbatches`, as `propose` does. The raw policy agents and random
# stay as they are, so that what a policy plays alone stays measured.
PIPELINED_AGENTS = ("expert", "greedy", "beam", "mcts", "ilp")


def pipeline_decider(spec: AgentSpec, ctx, seconds: float = 0.0):
  """How `spec`'s agent decides the other axes of a pipelined program, and at how many
  micro-batches a stage it tries: an `Auto` with the same agent (a policy guarded as
  `Auto(policy=...)` is; the ILP with a quarter of its time a count) at 2, 4, 8 and 16 for the
  ILP, 4 and 8 for the search agents, 8 for a policy, which answers in seconds (on Megatron-LM's
  Table 1 the guarded policy's answer was the same with 4 and 8, and never at 4)."""
  from partitioner.tactics import Auto
  memory = dict(hardware=ctx.hardware.name, memory=str(ctx.budget))
  if spec.kind == "expert":   # the pipelining hand schedules alone (`pipelined_plan`)
    return None, (2, 4, 8, 16)
  if spec.run is not None:
    search = "mcts" if spec.kind.startswith("policy+mcts") else "greedy"
    return (lambda rest: Auto(rest, policy=spec.run, agent=search, budget=spec.number or 1,
                              **memory)), (8,)
  if spec.kind == "ilp":
    return (lambda rest: Auto(rest, agent="ilp", budget=max(1, int(seconds / 4)), **memory)), \
        (2, 4, 8, 16)
  return (lambda rest: Auto(rest, agent=spec.kind, budget=spec.number or 50, **memory)), (4, 8)


def pipelined_plan(spec: AgentSpec, env, seconds: float = 0.0) -> dict | None:
  """`spec`'s agent again after a `Pipeline` over the mesh's outermost axis, where the step has
  a scanned layer stack (`agents.pipelines.pipelined`, `pipeline_decider`): the best that beats
  the plan `env` ended in, as the row's schedule and cost; None where none does."""
  from agents.pipelines import pipelined
  from environments.tasks import load_program
  from launch.auto import solve
  ctx = env.context
  decide, per_stage = pipeline_decider(spec, ctx, seconds)
  hand = ()
  if spec.kind == "expert":
    from corpus.experts import experts
    from corpus.registry import family_of
    from partitioner.cost import Placement
    hand = [(name, schedule) for name, schedule in experts(
        family_of(ctx.task.model), ctx.axes, Placement(ctx.mesh, ctx.hardware).innermost()
    ).items() if schedule.startswith("Pipeline(")]
    if not hand:
      return None
  staged = pipelined(load_program(ctx.task.model), ctx.mesh, ctx.hardware, ctx.budget, decide,
                     solve, base=spec.kind, hand=hand, per_stage=per_stage,
                     beat=env.exact_cost)
  if staged is None:
    return None
  return {"schedule": staged.schedule, "microbatches": staged.k,
          "step_time_s": staged.cost.step_time_s,
          "peak_memory_bytes": staged.cost.peak_memory_bytes,
          "fits": staged.cost.peak_memory_bytes <= ctx.budget}


def heads_padded_plan(spec: AgentSpec, env, staged: dict | None = None,
                      seconds: float = 0.0) -> dict | None:
  """Where some attention's heads do not divide an axis of the mesh (12 over 8), the agent's
  plan again after `HeadPadding` over that axis, which Megatron then splits by heads: the
  expert's Megatron hand schedules (`agents.guard.with_heads_padded`, as `propose` tries
  them), a search agent deciding every axis of the padded program itself (`Auto`, as for a
  pipeline: `pipeline_decider`; where that is over the budget, its decisions again with the
  fewest micro-batches that fit, as the guard cuts a padded plan). The fastest that fits and
  beats the plan `env` ended in and `staged` (a pipelined plan), as the row's schedule and
  cost; None where none does."""
  from agents.guard import with_heads_padded
  from agents.pipelines import even_share_s
  from environments.tasks import load_program
  from launch.auto import solve
  from partitioner.cost import simulate
  from partitioner.heads import pad_heads
  from partitioner.partition import PartitionedProgram
  from partitioner.tactics import HeadPadding
  ctx, cost = env.context, env.exact_cost
  program = load_program(ctx.task.model)
  beat = cost.step_time_s if cost.peak_memory_bytes <= ctx.budget else float("inf")
  if staged is not None and staged["fits"]:
    beat = min(beat, staged["step_time_s"])
  # Not over an axis where the padded program's computation shared by every device is no
  # faster than the plan to beat: heads padded many times over across a wide axis (HF Llama
  # 1B's 32 over 128 nodes: 2.5x the computation) leave nothing to find, and the search over
  # the padded program is most of the agent's time (60 of 103 s for the ILP there).
  axes = [a for a in ctx.axes if ctx.mesh.size(a) > 1 and
          (padded := pad_heads(program, ctx.mesh.size(a))) is not program and
          even_share_s(padded, ctx.mesh, ctx.task.hardware) < beat]
  if not axes:
    return None
  if spec.kind == "expert":
    from corpus.experts import experts
    from corpus.registry import family_of
    from partitioner.cost import Placement
    hand = [(name, schedule) for name, schedule in experts(
        family_of(ctx.task.model), ctx.axes, Placement(ctx.mesh, ctx.hardware).innermost()
    ).items() if "Megatron(" in schedule and not schedule.startswith("Pipeline(")]
    best = with_heads_padded(program, ctx, hand, beat)
    best = None if best is None else (best.pp, best.cost)
  else:
    from agents.guard import cut_to_fit
    from partitioner.tactics import Microbatch, parse_schedule
    decide, _ = pipeline_decider(spec, ctx, seconds)
    best = None
    for axis in axes:
      try:
        pp = PartitionedProgram(program, ctx.mesh).apply(
            [HeadPadding(axis), decide("+".join(ctx.axes))], solver=solve)
      except ShardzeroError:
        continue
      c = simulate(pp, ctx.task.hardware)
      if c.peak_memory_bytes > ctx.budget:   # its decisions again, with the fewest cuts that fit
        tactics = [t for t in parse_schedule(pp.decided)
                   if not isinstance(t, (HeadPadding, Microbatch))]
        cut = cut_to_fit(program, ctx, [HeadPadding(axis)], tactics, c.peak_memory_bytes,
                          c.memory.argument_bytes, 64)
        if cut is None:
          continue
        _, pp, c = cut
      if c.step_time_s < beat and (best is None or c.step_time_s < best[1].step_time_s):
        best = (pp, c)
  if best is None:
    return None
  pp, c = best
  return {"schedule": pp.decided, "step_time_s": c.step_time_s,
          "peak_memory_bytes": c.peak_memory_bytes, "fits": True}


def _policy(run: str):
  from launch.auto import POLICIES
  return POLICIES(run)


def _program_size(model: str) -> dict:
  from environments.tasks import load_program
  from partitioner.roles import roles
  program = load_program(model)
  params = sum(math.prod(program.values[v].shape) for v in roles(program).params)
  return {"ops": len(program.ops), "parameters": int(params)}


class Unit(NamedTuple):
  """What one worker evaluates: the agents missing on one task (sharing its traced program)."""
  task: EvalTask
  agents: tuple[tuple[str, str], ...]    # (agent text, version)
  max_steps: int
  seed: int


def run_unit(unit: Unit) -> list[dict]:
  """Evaluates each agent of `unit` on its task; an agent that fails gives a row with `error`.
  Under the shardzero command's collector settings (`launch.runtime.relax_gc`) in whatever
  process runs it (a spawned or Ray worker, a benchmark): with CPython's, the full collections
  of a process holding a few programs took 0.5-0.8 s of a guarded policy's 1.3-1.7 s."""
  from environments import EnvConfig, PartitioningEnv
  from launch.runtime import relax_gc
  relax_gc()
  task = unit.task
  base = {"task": task.key, "model": task.model, "mesh": task.mesh, "hardware": task.hardware,
          "budget": task.budget, "devices": task.devices, "max_steps": unit.max_steps,
          "seed": unit.seed}
  rows = []
  try:
    resolved = task.resolve()
    size = _program_size(task.model)
  except ShardzeroError as e:
    return [{**base, "agent": a, "version": v, "error": str(e)} for a, v in unit.agents]
  for text, version in unit.agents:
    row = {**base, **size, "agent": text, "version": version}
    try:
      spec = parse_agent(text)
      # A policy plays as many actions as it was trained to; the others, the unit's.
      steps = _policy(spec.run).max_steps if spec.run else unit.max_steps
      env = PartitioningEnv(resolved, seed=unit.seed, config=EnvConfig(max_steps=steps))
      env.reset()
      row.update(_run_agent(spec, env, unit.seed))
      cost, ctx = env.exact_cost, env.context
      row.update({"budget_bytes": ctx.budget, "step_time_s": cost.step_time_s,
                  "peak_memory_bytes": cost.peak_memory_bytes,
                  "fits": cost.peak_memory_bytes <= ctx.budget,
                  "schedule": env.partitioned.strategy, "actions": len(env.history)})
      cut = row.get("heads_padded") or row.get("microbatched") or row.get("pipelined")
      if cut:
        row.update({"step_time_s": cut["step_time_s"], "fits": cut.get("fits", True),
                    "peak_memory_bytes": cut["peak_memory_bytes"], "schedule": cut["schedule"]})
    except ShardzeroError as e:
      row["error"] = str(e)
    except Exception as e:     # a bug: reported with the others, the rest of the run goes on
      row["error"] = f"{type(e).__name__}: {e}"
    rows.append(row)
  # Its agents are done with the task's contexts (their cached states, and those of the
  # sub-tasks an agent made); kept, a process running the external suite's 36 tasks one after
  # another grew past 22 GB on the 32nd (session 73). The traced programs stay shared.
  from environments.tasks import TASKS
  TASKS.contexts.clear()
  return rows


# ------------------------------------------------------------------------------ the store
_KEYS = ("agent", "version", "task", "max_steps", "seed")


def _complete(row) -> bool:
  return isinstance(row, dict) and all(k in row for k in _KEYS) and (
      "error" in row or all(k in row for k in ("step_time_s", "fits", "decide_s")))


class ResultsStore:
  """Results as JSON lines in `path`, one per (agent, version, task, max steps, seed); a line
  cut short by a crash is skipped with a warning, never fatal."""

  def __init__(self, path: str):
    self.path = path
    self.rows: list[dict] = []
    self.damaged = 0
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          try:
            row = json.loads(line)
          except json.JSONDecodeError:
            row = None
          if _complete(row):
            self.rows.append(row)
          else:
            self.damaged += 1
    self._done = {self.key(r) for r in self.rows if "error" not in r}

  @staticmethod
  def key(row: dict) -> tuple:
    return tuple(row[k] for k in _KEYS)

  def has(self, key: tuple) -> bool:
    """Whether `key` has a result (a stored error is tried again)."""
    return key in self._done

  def add(self, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    with open(self.path, "a") as f:
      for row in rows:
        f.write(json.dumps(row, sort_keys=True) + "\n")
      f.flush()
      os.fsync(f.fileno())
    self.rows += rows
    self._done |= {self.key(r) for r in rows if "error" not in r}

  def best_known(self) -> dict[str, float]:
    """Per task: the step time of the best result stored (`corpus.experts.preference`: the
    fastest that fits, else the one closest to fitting)."""
    return {task: step for task, (step, _) in self._best().items()}

  def feasible(self) -> set[str]:
    """The tasks where a stored result fits the budget."""
    return {task for task, (_, fits) in self._best().items() if fits}

  def _best(self) -> dict[str, tuple[float, bool]]:
    from corpus.experts import preference
    best: dict[str, tuple] = {}
    for r in self.rows:
      if "error" in r or not costed_now(r["version"]):   # costed by another model
        continue
      cand = (preference(r["step_time_s"], r["peak_memory_bytes"], r["fits"]), r["step_time_s"],
              bool(r["fits"]))
      if r["task"] not in best or cand < best[r["task"]]:
        best[r["task"]] = cand
    return {k: v[1:] for k, v in best.items()}

  def latest(self, keys: Iterable[tuple]) -> list[dict]:
    """The stored row of each key (the last one written)."""
    by_key = {self.key(r): r for r in self.rows}
    return [by_key[k] for k in keys if k in by_key]


REPLAYS = 3   # a task's fastest plans of earlier cost models priced again, at most


def earlier_plans(store: "ResultsStore", task_key: str, best: float) -> list[dict]:
  """The stored plans of `task_key` that an earlier cost model priced faster than `best` (the
  best known under the current one) and that fit under it (the fastest `REPLAYS` schedules),
  not yet priced again. The best known counts only rows of the current model, so without these
  a cost model's bump drops the ILP's and MCTS's best plans until those agents run again, and
  every other agent's ratio looks better than it is."""
  replayed = {r["schedule"] for r in store.rows
              if r["task"] == task_key and r["agent"].startswith("replay:") and "error" not in r
              and costed_now(r["version"])}
  plans, seen = [], set()
  for r in sorted((r for r in store.rows if r["task"] == task_key and "error" not in r
                   and not costed_now(r["version"]) and r.get("fits") and r.get("schedule")
                   and r["step_time_s"] < best), key=lambda r: r["step_time_s"]):
    if r["schedule"] not in seen and r["schedule"] not in replayed:
      seen.add(r["schedule"])
      plans.append(r)
  return plans[:REPLAYS]


def replay_plans(task, plans: list[dict]) -> list[dict]:
  """`plans` (stored rows of `task`) priced again under the current cost model, as rows of the
  pseudo-agent `replay:<agent>` (never in a table, only in the best known); a schedule that no
  longer applies is left out."""
  from environments.tasks import load_program
  from partitioner.cost import load_hardware, simulate
  from partitioner.partition import apply
  budget = task.resolve().memory_budget or load_hardware(task.hardware).hbm_bytes
  program = load_program(task.model)
  rows = []
  for r in plans:
    try:
      cost = simulate(apply(program, task.mesh, r["schedule"]), task.hardware)
    except ShardzeroError:
      continue
    rows.append({k: r[k] for k in ("task", "model", "mesh", "hardware", "budget", "devices",
                                   "max_steps", "seed") if k in r} | {
        # A plan replayed before keeps the agent and version that found it.
        "agent": r["agent"] if r["agent"].startswith("replay:") else f"replay:{r['agent']}",
        "version": f"replay-v1-c{_cost_model_version()}", "replayed": r.get("replayed",
                                                                             r["version"]),
        "schedule": r["schedule"], "step_time_s": cost.step_time_s,
        "peak_memory_bytes": cost.peak_memory_bytes, "budget_bytes": budget,
        "fits": cost.peak_memory_bytes <= budget, "decide_s": 0.0})
  return rows


def with_ratios(rows: list[dict], best: dict[str, float],
                feasible: set[str] | None = None) -> list[dict]:
  """Each row with its ratio to the best known, whether that is within 10% and fits, and
  whether any plan of the task fits (`feasible`: the tasks where one does; default all)."""
  out = []
  for r in rows:
    b = best.get(r["task"])
    ratio = r["step_time_s"] / b if "error" not in r and b else None
    out.append({**r, "best_known_s": b, "ratio": ratio,
                "within": ratio is not None and ratio <= WITHIN and r["fits"],
                "feasible": feasible is None or r["task"] in feasible})
  return out


def split_of(model: str) -> str:
  """The corpus split of a model's family ("train", "heldout", "real", "external"), or
  "user"."""
  import corpus
  family = corpus.family_of(model)
  return corpus.FAMILIES[family].split if family is not None else "user"


def summarize(rows: list[dict], split: str | None = None) -> list[dict]:
  """Per (agent, number of devices): tasks, and over those where some plan fits the budget
  the mean and worst ratio to the best known and the share within 10% (and fitting); the
  tasks where nothing fits, whose ratios compare plans that do not (the best known is the one
  closest to fitting), counted apart; mean decision time. Over one corpus split if given."""
  groups: dict = {}
  for r in rows:
    if split is not None and split_of(r["model"]) != split:
      continue
    groups.setdefault((r["agent"], r["devices"]), []).append(r)
  out = []
  for (agent, devices), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ran = [r for r in rs if r.get("ratio") is not None]
    ok = [r for r in ran if r.get("feasible", True)]
    out.append({"agent": agent, "devices": devices, "tasks": len(rs), "errors": len(rs) - len(ran),
                "nothing_fits": len(ran) - len(ok),
                "mean_ratio": sum(r["ratio"] for r in ok) / len(ok) if ok else None,
                "worst_ratio": max((r["ratio"] for r in ok), default=None),
                "within_10pct": sum(r["within"] for r in ok) / len(ok) if ok else None,
                "mean_decide_s": sum(r["decide_s"] for r in ran) / len(ran) if ran else None})
  return out

"""`PartitioningEnv`: choosing tactics for a task as a dm-env environment.

Each step applies one action (tile a decision point, a manual tactic, or finish) with the
rewriting partitioner and re-simulates the result. The reward is the normalised improvement of
the simulated step time, less a penalty for every step that ends over the memory budget:

    r_t = (c_{t-1} - c_t) / c_0 - memory_penalty * (1 + (peak_t - budget) / budget)  if over,
    r_t = (c_{t-1} - c_t) / c_0                                                     otherwise,

so the undiscounted return is (c_0 - c_T) / c_0 minus the penalties. The fixed part makes
fitting the budget matter more than any speed-up (which is below 1), as it does in practice. An episode ends on
finish, when nothing but finish is legal, or after `max_steps` (a truncation: discount 1).

States reached by the same actions are shared through a per-task cache, so clones (what search
agents plan with) and repeated episodes re-simulate nothing they have seen.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Sequence

import dm_env
import numpy as np
from dm_env import specs

from environments.actions import (ENDINGS, Action, DecisionPoint, action_space, decision_points,
                                  tile_problem)
from environments.observations import Sizes, StaticGraph, dynamic_features, observation_spec
from environments.states import StateCache, StateInfo, ZobristHash
from environments.tasks import (TASKS, Task, TaskCache, TaskDistribution, folded_program,
                               load_program)
from partitioner.errors import ShardzeroError, WorkloadError
from partitioner.mesh import Mesh
from partitioner.partition import PartitionedProgram
from partitioner.roles import aliased_outputs
from partitioner.tactics import Tile, ZeRO, tactic_problem


class InvalidActionError(ShardzeroError):
  """An action that is out of range or masked in the current state."""


class TaskContext:
  """What every episode of one task shares: the program, the action space, the static arrays,
  the simulator and the cache of states by action sequence.

  By default episodes start unpartitioned with actions over every mesh axis; `start` (a
  partitioned program of the task's mesh) and `axes` make a sub-problem, which is what an
  automatic tactic inside a manual schedule solves.

  With `fold` (the default), a corpus model deeper than three layers is played on its
  three-layer trace with a middle layer that counts for the others (`partitioner.folding`):
  the same actions, costs within a fraction of a percent, a step several times cheaper.
  `unfolded` and `exact_cost` give the task's own program and its simulated cost."""

  def __init__(self, task: Task, pad_to: Sizes | None = None, cache_size: int = 256, *,
               start: PartitionedProgram | None = None, axes: Sequence[str] | None = None,
               fold: bool = True):
    from partitioner.cost import Simulator, load_hardware
    self.task = task
    self.folding = folded_program(dataclasses.replace(task, memory_budget=None)) \
        if fold and start is None else None
    if start is not None:
      program = start.program
    elif self.folding is not None:
      program = self.folding.program
    else:
      program = load_program(task.model)
    self.program = program
    self.mesh = mesh = Mesh.parse(task.mesh)
    if start is not None and start.mesh.axes != mesh.axes:
      raise ShardzeroError(f"the start state is over {start.mesh}, the task over {task.mesh}")
    self.hardware = load_hardware(task.hardware)
    self.budget = task.memory_budget or self.hardware.hbm_bytes
    self.simulator = Simulator(program, mesh, self.hardware, folding=self.folding)
    self.points: list[DecisionPoint] = decision_points(program)
    self.axes = tuple(a for a in mesh.names if axes is None or a in axes)   # what it acts over
    self.actions: list[Action] = action_space(program, mesh, self.points, axes,
                                              cuts=start is None)
    try:
      self.graph = StaticGraph(program, mesh, self.hardware, self.points, self.actions, pad_to)
    except WorkloadError as e:   # the padding a training run chose: say which task outgrew it
      raise WorkloadError(f"{task.model} on {task.mesh}: {e}") from None
    self.finish = len(self.actions) - 1
    self.index = {str(a): i for i, a in enumerate(self.actions)}
    self._members = {m for p in self.points for m in p.members}
    # Per value: the tile actions whose legality depends on its sharding.
    self._tiles_of: dict[int, list[int]] = collections.defaultdict(list)
    for i, action in enumerate(self.actions):
      if action.kind == "tile":
        for m in self.points[action.point].members:
          for v in (m,) + aliased_outputs(program, m):
            self._tiles_of[v].append(i)
    self._tiles = [i for i, a in enumerate(self.actions) if a.kind == "tile"]
    self._others = [i for i, a in enumerate(self.actions) if a.kind != "tile"]
    # Per manual tactic but ZeRO and the endings: the values whose sharding its legality
    # depends on.
    self._footprint = {i: fp for i, fp in self.graph.footprints.items()
                       if self.actions[i].kind not in ("ZeRO", *ENDINGS)}
    self._hash = ZobristHash()
    self.states = StateCache(cache_size)
    self.root = self._make(start if start is not None else PartitionedProgram(program, mesh), None)

  # ---------------------------------------------------------------------------------- states
  def state(self, history: tuple[int, ...], parent: StateInfo) -> StateInfo:
    """The state after `history` (whose last action is applied to `parent`)."""
    info = self.states.get(history)
    if info is None:
      action = self.actions[history[-1]]
      if action.kind in ENDINGS:
        info = self._rewritten(parent, action.tactic)
      else:
        info = self._make(parent.pp.apply(action.tactic), parent)
      self.states.put(history, info)
    return info

  def _rewritten(self, parent: StateInfo, tactic) -> StateInfo:
    """The last state of an episode that ends rewriting the step (cutting the batch,
    recomputing the activations): `parent`'s schedule after `tactic` on the task's own program
    (a folded program's layers do not fold once rewritten: a cut's loop carries differ from
    depth to depth, and recomputation moves ops across layers), simulated whole. Only finish
    is legal after it; its observation is `parent`'s shardings with its own cost.

    Where the schedule does not apply to the rewritten step (propagation can reach further
    through the loop, so that a later tile conflicts; or the step traces differently at a
    micro-batch's size), the episode ends as finish would: `parent` itself, unrewritten. Which
    plans replay so is known only by replaying them, too dear for every state's mask."""
    from partitioner.cost import simulate
    mask = np.zeros(self.graph.sizes.actions, bool)
    mask[self.finish] = True
    try:
      pp = PartitionedProgram(self.whole_program(), self.mesh).apply(
          (tactic,) + parent.pp.schedule)
    except ShardzeroError as e:
      return parent._replace(mask=mask, problems={-1: f"{tactic} does not apply: {e}"},
                             key=hash((parent.key, "uncut")))
    return StateInfo(pp, simulate(pp, self.hardware), mask, parent.sharding, {},
                     hash((parent.key, str(tactic))), parent.layout, parent.terms)

  def whole_program(self):
    """The task's own program: what the episode plays on, unless folded (`start`: a
    sub-problem's)."""
    return self.program if self.folding is None else load_program(self.task.model)

  def _make(self, pp: PartitionedProgram, parent: StateInfo | None) -> StateInfo:
    state = pp.state
    if parent is None:
      sharding = self.graph.empty_sharding()
      changed = range(len(self.program.values))
    else:
      sharding = parent.sharding.copy()
      changed = sorted(state.changed)
    origin, dims, members = state.origin, state.dims, self._members
    decided = [v in members and any(
        (o := origin.get((v, a))) is not None and o.op is None for d in dims[v] for a in d)
        for v in changed]
    layout_ids = state.layout_ids
    self.graph.sharding_rows(dims, layout_ids, changed, decided, sharding)
    terms, layout = (self._hash.root(layout_ids) if parent is None else
                     self._hash.step(parent.terms, parent.layout, layout_ids, changed))
    key = hash((layout, tuple(sorted(state.forbidden.items())),
                frozenset(t for t in pp.schedule if not isinstance(t, Tile))))
    return StateInfo(pp, self.simulator(pp), self._mask(pp, parent), sharding, {}, key, layout,
                     terms)

  def _mask(self, pp: PartitionedProgram, parent: StateInfo | None) -> np.ndarray:
    """The legal actions. A tile's legality depends on its members' shardings only, and a
    manual tactic's on its footprint's, so the bits of those that did not change since
    `parent` are kept."""
    state = pp.state
    fresh = parent is None or state.forbidden != parent.pp.state.forbidden
    if fresh:
      mask, tiles = np.zeros(self.graph.sizes.actions, bool), self._tiles
    else:
      mask = parent.mask.copy()
      tiles = {i for v in state.changed for i in self._tiles_of.get(v, ())}
    for i in tiles:
      action = self.actions[i]
      mask[i] = tile_problem(state, self.points[action.point], action.dim, action.axis) is None
    applied = set(pp.schedule)
    zero_axes = {t.axis for t in applied if isinstance(t, ZeRO)}
    for i in self._others:
      action = self.actions[i]
      if action.kind == "finish":
        mask[i] = True
      elif action.kind in ENDINGS:   # legal from the start (a count divides the batch; the
        # activations of a straight-line step can be recomputed)
        mask[i] = True
      elif action.kind == "ZeRO":
        mask[i] = action.axis not in zero_axes
      elif action.tactic in applied:
        mask[i] = False
      elif fresh or not self._footprint[i].isdisjoint(state.changed):
        mask[i] = tactic_problem(action.tactic, state, len(pp.schedule)) is None
    return mask

  def unfolded(self, pp: PartitionedProgram) -> PartitionedProgram:
    """`pp`'s schedule applied to the task's own program (`pp` itself unless folded, or cut
    into micro-batches: that is played on the task's own program)."""
    if self.folding is None or pp.program is not self.program:
      return pp
    return PartitionedProgram(load_program(self.task.model), self.mesh).apply(pp.schedule)

  def exact_cost(self, pp: PartitionedProgram):
    """The simulated cost of `pp`'s schedule on the task's own program."""
    from partitioner.cost import simulate
    if pp.program is not self.program:   # cut into micro-batches: simulated whole
      return simulate(pp, self.hardware)
    return simulate(self.unfolded(pp), self.task.hardware) if self.folding else self.simulator(pp)

  def with_budget(self, task: Task) -> "TaskContext":
    """This context for `task`, the same task at another memory budget. The budget only enters
    the reward and the observation's globals, so the states, their cache and the static arrays
    are shared: the tight-budget variant of a training task costs nothing to set up."""
    if dataclasses.replace(task, memory_budget=None) != dataclasses.replace(
        self.task, memory_budget=None):
      raise ShardzeroError(f"{task} is not {self.task} at another budget")
    new = copy.copy(self)
    new.task, new.budget = task, task.memory_budget or self.hardware.hbm_bytes
    return new

  def problem(self, info: StateInfo, index: int) -> str:
    """Why action `index` is masked in `info`."""
    if index not in info.problems:
      action, pp = self.actions[index], info.pp
      if pp.program is not self.program or -1 in info.problems:
        why = ("the episode ended cutting the batch into micro-batches" +
               (f" ({info.problems[-1]}: it ends as finish would)" if -1 in info.problems else ""))
      elif action.kind == "tile":
        why = tile_problem(pp.state, self.points[action.point], action.dim, action.axis)
      elif action.kind == "ZeRO":
        why = f"ZeRO over {action.axis!r} was applied already"
      elif action.tactic in pp.schedule:
        why = "it was applied already"
      else:
        why = tactic_problem(action.tactic, pp.state, len(pp.schedule))
      info.problems[index] = why or "it is not legal here"
    return info.problems[index]


def task_context(task: Task, pad_to: Sizes | None = None, fold: bool = True, *,
                 cache: TaskCache = TASKS) -> TaskContext:
  """The shared context of a task, with its cached states (by default in the process's
  `environments.tasks.TASKS`). The budgets of one task share one context: the budget enters
  only the reward and the observation."""
  if task.memory_budget is not None:
    unbudgeted = dataclasses.replace(task, memory_budget=None)
    return task_context(unbudgeted, pad_to, fold, cache=cache).with_budget(task)
  return cache.contexts.get_or_make((task, pad_to, fold),
                                    lambda: TaskContext(task, pad_to, fold=fold))


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  max_steps: int = 24
  memory_penalty: float = 1.0


class PartitioningEnv(dm_env.Environment):
  """Partitioning one task per episode, drawn from `tasks` (a `Task`, a list of tasks, or a
  `TaskDistribution`) with the environment's own seeded generator; or always the one task of
  a given `TaskContext`. `fold`: play deep corpus models folded (see `TaskContext`)."""

  def __init__(self, tasks: Task | Sequence[Task] | TaskDistribution | TaskContext, *,
               seed: int = 0, config: EnvConfig = EnvConfig(), pad_to: Sizes | None = None,
               fold: bool = True):
    self._fixed = tasks if isinstance(tasks, TaskContext) else None
    if self._fixed is not None:
      tasks = [self._fixed.task]
    if isinstance(tasks, Task):
      tasks = [tasks]
    if not isinstance(tasks, TaskDistribution) and not tasks:
      raise ShardzeroError("PartitioningEnv needs at least one task")
    self._tasks = tasks
    self._rng = np.random.default_rng(seed)
    self.config = config
    self._pad_to, self._fold = pad_to, fold
    self._ctx: TaskContext | None = None
    self._info: StateInfo | None = None
    self._history: tuple[int, ...] = ()
    self._done = True
    self._fresh = True
    if self._fixed is not None:
      self._ctx = self._fixed
    elif not isinstance(tasks, TaskDistribution) and len(tasks) == 1:
      self._ctx = task_context(tasks[0], pad_to, fold)   # specs are known before the first reset

  # ------------------------------------------------------------------------------ dm_env API
  def reset(self) -> dm_env.TimeStep:
    if isinstance(self._tasks, TaskDistribution):
      task = self._tasks.sample(self._rng)
    else:
      task = self._tasks[int(self._rng.integers(len(self._tasks)))]
    self._ctx = self._fixed or task_context(task, self._pad_to, self._fold)
    self._info, self._history = self._ctx.root, ()
    self._done, self._fresh = False, False
    return dm_env.restart(self._observation())

  def step(self, action) -> dm_env.TimeStep:
    if self._done:
      return self.reset()
    ctx, info = self._ctx, self._info
    index = self._check(action)
    history = self._history + (index,)
    if index == ctx.finish:
      next_info = info
    else:
      next_info = ctx.state(history, info)
    c0 = ctx.root.cost.step_time_s
    reward = (info.cost.step_time_s - next_info.cost.step_time_s) / c0 - self.penalty(next_info)
    self._info, self._history = next_info, history
    legal = np.flatnonzero(next_info.mask)
    if index == ctx.finish or (len(legal) == 1 and legal[0] == ctx.finish):
      self._done = True
      return dm_env.termination(np.float64(reward), self._observation())
    if len(history) >= self.config.max_steps:
      self._done = True
      return dm_env.truncation(np.float64(reward), self._observation())
    return dm_env.transition(np.float64(reward), self._observation())

  def observation_spec(self):
    return observation_spec(self._context().graph.sizes)

  def action_spec(self) -> specs.DiscreteArray:
    return specs.DiscreteArray(self._context().graph.sizes.actions, name="action")

  def reward_spec(self):
    return specs.Array((), np.float64, "reward")

  # ---------------------------------------------------------------------------- for agents
  def clone(self) -> "PartitioningEnv":
    """An independent copy in the same state (it shares the task's cached states)."""
    new = copy.copy(self)
    new._rng = copy.deepcopy(self._rng)   # the same draws from here on, independently
    return new

  def restart_clone(self) -> "PartitioningEnv":
    """A copy at the start of the current episode (the same task, nothing applied)."""
    new = self.clone()
    new._info, new._history, new._done = self._context().root, (), False
    return new

  @property
  def task(self) -> Task:
    return self._context().task

  @property
  def context(self) -> TaskContext:
    return self._context()

  @property
  def partitioned(self) -> PartitionedProgram:
    return self._state().pp

  @property
  def cost(self):
    """The CostReport of the current state."""
    return self._state().cost

  @property
  def exact_cost(self):
    """The CostReport of the current schedule on the task's own program: `cost`, unless the
    task is played folded (then a simulation of the whole program)."""
    ctx, info = self._context(), self._state()
    return info.cost if ctx.folding is None or info.pp.program is not ctx.program else \
        ctx.exact_cost(info.pp)

  @property
  def history(self) -> tuple[int, ...]:
    return self._history

  @property
  def done(self) -> bool:
    return self._done

  @property
  def finish_action(self) -> int:
    return self._context().finish

  @property
  def state_key(self) -> int:
    """Equal for equal partitioning states, whatever the order of the actions that led there."""
    return self._state().key

  def observation(self) -> dict:
    """The observation of the current state (what the last timestep carried)."""
    self._state()
    return self._observation()

  def legal_actions(self) -> np.ndarray:
    return np.flatnonzero(self._state().mask)

  def action_name(self, index: int) -> str:
    return str(self._context().actions[index])

  def action_index(self, text: str) -> int:
    """The index of an action written as a tactic (`"Megatron(model)"`) or `"Finish"`."""
    from partitioner.tactics import parse_tactic
    ctx = self._context()
    key = "Finish" if text.strip() == "Finish" else str(parse_tactic(text))
    if key not in ctx.index:
      raise InvalidActionError(f"{text!r} is not an action of task {ctx.task}")
    return ctx.index[key]

  @property
  def fits(self) -> bool:
    """Whether the current state's peak memory is within the task's budget."""
    return self.cost.peak_memory_bytes <= self._context().budget

  def penalty(self, info: StateInfo | None = None) -> float:
    info = info or self._state()
    over = info.cost.peak_memory_bytes / self._ctx.budget - 1.0
    return self.config.memory_penalty * (1.0 + over) if over > 0 else 0.0

  def score(self) -> float:
    """What search agents maximise: the improvement of the current state over the start,
    less one memory penalty: (c_0 - c) / c_0 - penalty."""
    c0 = self._ctx.root.cost.step_time_s
    return (c0 - self.cost.step_time_s) / c0 - self.penalty()

  # ---------------------------------------------------------------------------- internals
  def _context(self) -> TaskContext:
    if self._ctx is None:
      raise ShardzeroError("the environment has no task yet: call reset() first")
    return self._ctx

  def _state(self) -> StateInfo:
    if self._info is None:
      raise ShardzeroError("the environment has no state yet: call reset() first")
    return self._info

  def _check(self, action) -> int:
    ctx = self._ctx
    try:
      index = int(np.asarray(action).item())
    except (TypeError, ValueError):
      raise InvalidActionError(f"an action is one integer, got {action!r}") from None
    if not 0 <= index < len(ctx.actions):
      raise InvalidActionError(f"action {index} is out of range: task {ctx.task} has "
                               f"{len(ctx.actions)} actions (0..{len(ctx.actions) - 1})")
    if not self._info.mask[index]:
      raise InvalidActionError(f"action {index} ({ctx.actions[index]}) is not legal here: "
                               f"{ctx.problem(self._info, index)}")
    return index

  def _observation(self) -> dict:
    ctx, info = self._ctx, self._info
    dynamic = dynamic_features(info.cost, ctx.root.cost.step_time_s, ctx.budget,
                               len(self._history) / self.config.max_steps)
    return ctx.graph.observation(info.sharding, info.mask, dynamic)

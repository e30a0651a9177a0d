"""Solving an `Auto` tactic with a search agent: the agent plays one episode of the
sub-problem that starts where the schedule got to and may act only over the tactic's axes;
the tactics of the actions it took are what `Auto` applies. `solve` is the solver to pass to
`partitioner.apply(..., solver=...)` (`launch.auto.solve` adds trained policies)."""

from __future__ import annotations

from agents.environment_loop import EnvironmentLoop
from agents.loggers import InMemoryLogger
from environments import EnvConfig, PartitioningEnv, Task, TaskContext, parse_bytes
from partitioner.errors import ScheduleError
from partitioner.partition import PartitionedProgram
from partitioner.tactics import AutoRequest, Tactic

DEFAULT_MAX_STEPS = 12
AGENTS = ("beam", "greedy", "ilp", "mcts", "random")


def sub_environment(request: AutoRequest, max_steps: int) -> PartitioningEnv:
  """The environment of an `Auto` request: its start state, axes, hardware and budget."""
  t, state = request.tactic, request.state
  start = PartitionedProgram(state.program, state.mesh, state, request.schedule)
  task = Task(f"auto:{len(state.program.ops)}-ops", str(state.mesh), t.hardware,
              parse_bytes(t.memory) if t.memory else None)
  context = TaskContext(task, start=start, axes=request.axes)
  env = PartitioningEnv(context, config=EnvConfig(max_steps=max_steps))
  env.reset()
  return env


def chosen_tactics(env: PartitioningEnv) -> list[Tactic]:
  actions = env.context.actions
  return [actions[i].tactic for i in env.history if i != env.finish_action]


def solve(request: AutoRequest) -> list[Tactic]:
  """The tactics a search agent (`greedy`, `beam`, `mcts`, `random`, or `ilp` with `budget`
  seconds) chooses for `request`."""
  from agents.search.baselines import GreedyActor, RandomActor
  from agents.search.beam import BeamActor
  from agents.search.ilp import ILPActor
  from agents.search.mcts import MCTSActor
  t = request.tactic
  if t.policy:
    raise ScheduleError(f"{t}: a policy needs a solver that loads trained policies "
                        "(launch.auto.solve, what `shardzero partition` uses)")
  if t.agent not in AGENTS:
    raise ScheduleError(f"Auto: unknown agent {t.agent!r}; known: {', '.join(AGENTS)} "
                        "(or policy=RUN_DIR)")
  if t.budget < 1:
    raise ScheduleError(f"{t}: budget must be positive")
  env = sub_environment(request, t.max_steps or DEFAULT_MAX_STEPS)
  actor = {"greedy": lambda: GreedyActor(env),
           "beam": lambda: BeamActor(env, budget=t.budget),
           "mcts": lambda: MCTSActor(env, budget=t.budget),
           "random": lambda: RandomActor(seed=0),
           "ilp": lambda: ILPActor(env, time_limit_s=float(t.budget))}[t.agent]()
  # The loop resets the environment, which for a sub-problem means back to its start state.
  EnvironmentLoop(env, actor, logger=InMemoryLogger(), should_update=False).run_episode()
  return chosen_tactics(env)

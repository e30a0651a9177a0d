"""The solvers behind the `Auto` tactic: an agent plays one episode of the sub-problem that
starts where the schedule got to and may act only over the tactic's axes; the tactics of the
actions it took are what `Auto` applies. Importing this module registers them."""

from __future__ import annotations

import functools
import os

from agents.environment_loop import EnvironmentLoop
from agents.loggers import InMemoryLogger
from environments import EnvConfig, PartitioningEnv, Task, TaskContext, parse_bytes
from partitioner.errors import ScheduleError
from partitioner.partition import PartitionedProgram
from partitioner.tactics import AUTO_SOLVERS, AutoRequest, Tactic

DEFAULT_MAX_STEPS = 12


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


def _search(request: AutoRequest) -> list[Tactic]:
  from agents.baselines import GreedyActor, RandomActor
  from agents.beam import BeamActor
  from agents.mcts import MCTSActor
  t = request.tactic
  if t.budget < 1:
    raise ScheduleError(f"{t}: budget must be positive")
  env = sub_environment(request, t.max_steps or DEFAULT_MAX_STEPS)
  actor = {"greedy": lambda: GreedyActor(env),
           "beam": lambda: BeamActor(env, budget=t.budget),
           "mcts": lambda: MCTSActor(env, budget=t.budget),
           "random": lambda: RandomActor(seed=0)}[t.agent]()
  # The loop resets the environment, which for a sub-problem means back to its start state.
  EnvironmentLoop(env, actor, logger=InMemoryLogger(), should_update=False).run_episode()
  return chosen_tactics(env)


@functools.lru_cache(maxsize=4)
def _load(run_dir: str, modified: float):
  from agents.learned.inference import load_policy
  return load_policy(run_dir)


def _policy(request: AutoRequest) -> list[Tactic]:
  from agents.learned.inference import play_policy
  from learners.checkpointing import FILENAME
  t = request.tactic
  if t.agent not in ("greedy", "mcts"):
    raise ScheduleError(f"{t}: with a policy, agent is greedy (decoding) or mcts "
                        "(policy-guided search)")
  path = os.path.join(t.policy, FILENAME)
  policy = _load(t.policy, os.path.getmtime(path) if os.path.exists(path) else 0.0)
  env = sub_environment(request, t.max_steps or policy.max_steps)
  play_policy(env, policy, t.agent, t.budget)
  return chosen_tactics(env)


AUTO_SOLVERS.update({"greedy": _search, "beam": _search, "mcts": _search, "random": _search,
                     "policy": _policy})

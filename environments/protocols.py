"""What agents may use of an environment beyond dm-env's API (`SearchEnvironment`).

Search agents plan with copies of the environment they act in, as Acme's MCTS plans with an
environment model; this is everything they may call, so another environment that provides it
(a different simulator, a remote one) serves every agent unchanged. `PartitioningEnv` is the
implementation."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import dm_env
import numpy as np


@runtime_checkable
class SearchEnvironment(Protocol):
  # dm-env
  def reset(self) -> dm_env.TimeStep: ...
  def step(self, action) -> dm_env.TimeStep: ...
  def observation_spec(self): ...
  def action_spec(self): ...

  # Branching: copies share the task's cached states, so revisiting a state costs nothing.
  def clone(self) -> "SearchEnvironment":
    """An independent copy in the same state."""

  def restart_clone(self) -> "SearchEnvironment":
    """A copy at the start of the current episode."""

  # The current state.
  def observation(self) -> dict:
    """What the last timestep carried."""

  def legal_actions(self) -> np.ndarray:
    """Indices of the actions legal now (finish included)."""

  def score(self) -> float:
    """What search maximises: the improvement of the step time over the start, less one
    memory penalty when over the budget."""

  @property
  def history(self) -> tuple[int, ...]:
    """The actions taken this episode."""

  @property
  def done(self) -> bool: ...

  @property
  def finish_action(self) -> int: ...

  @property
  def state_key(self) -> int:
    """Equal for equal states, whatever the order of the actions that reached them."""

  @property
  def cost(self) -> Any:
    """The simulated `CostReport` of the current state (of the folded program, if played
    folded)."""

  @property
  def exact_cost(self) -> Any:
    """The `CostReport` of the current schedule on the task's own program."""

  @property
  def fits(self) -> bool: ...

  @property
  def config(self) -> Any:
    """The episode's settings (`EnvConfig`: max_steps, memory_penalty)."""

  @property
  def partitioned(self) -> Any:
    """The current `PartitionedProgram`."""

  # The task and its action space.
  @property
  def task(self) -> Any: ...

  @property
  def context(self) -> Any:
    """The task's shared `TaskContext`: its program, mesh, hardware, budget, decision points
    and actions (read only)."""

  def action_index(self, text: str) -> int:
    """The index of an action written as a tactic, or "Finish"."""

  def action_name(self, index: int) -> str: ...

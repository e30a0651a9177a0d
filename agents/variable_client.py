"""Parameters between the learner and the actors: a one-item Reverb table holds the latest
parameters with their version; actors pull them every `update_period` calls (Acme's
`VariableClient`). A second one holds their moving average, which the evaluator reads when the
learner keeps one."""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from agents.core import VariableSource

PARAMS_TABLE = "params"
AVERAGE_TABLE = "average_params"


def publish(client, params, version: int, table: str = PARAMS_TABLE) -> None:
  """Replaces the table's parameters with `params` at `version`."""
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
  client.insert(leaves + [np.int64(version)], priorities={table: 1.0})


class ReverbVariableSource(VariableSource):
  """Reads the latest parameters (and version) from the parameter table. `treedef` is the
  structure of the parameters (from `networks.init`), which the table does not keep."""

  def __init__(self, client, treedef, table: str = PARAMS_TABLE):
    self._client, self._treedef, self._table = client, treedef, table

  def available(self) -> bool:
    return self._client.server_info()[self._table].current_size > 0

  def get_variables(self, names):
    sample = next(self._client.sample(self._table, num_samples=1, emit_timesteps=False))
    data = [np.asarray(x)[0] for x in sample.data]   # legacy items carry a time dim of 1
    params = jax.tree_util.tree_unflatten(self._treedef, data[:-1])
    return [(params, int(data[-1])) for _ in names]


class LearnerVariableSource(VariableSource):
  """The learner itself as a source (single-process runs and tests), serving its `variables`
  ("policy" or "average") under any name."""

  def __init__(self, learner, variables: str = "policy"):
    self._learner, self._variables = learner, variables

  def get_variables(self, names):
    params = self._learner.get_variables([self._variables])[0]
    return [(params, self._learner.version) for _ in names]


class VariableClient:
  """Holds the actor's copy of the parameters and their version; `update()` refreshes it every
  `update_period` calls, `update_and_wait()` now."""

  def __init__(self, source: VariableSource, update_period: int = 1,
               initial: Optional[tuple[Any, int]] = None):
    self._source = source
    self._period = max(1, update_period)
    self._calls = 0
    self.params, self.version = initial if initial is not None else (None, -1)

  def update(self, wait: bool = False) -> None:
    self._calls += 1
    if wait or self.params is None or self._calls >= self._period:
      self.update_and_wait()

  def update_and_wait(self) -> None:
    self._calls = 0
    self.params, self.version = self._source.get_variables(["policy"])[0]

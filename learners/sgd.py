"""A learner that minimises a loss on batches from an iterator with Optax (Acme's SGD learner).

The update is a pure function `(TrainingState, batch) -> (TrainingState, metrics)` jitted once;
only the learner object holds the state. The parameter version is the number of updates, so an
actor that records it with its data lets the learner measure policy lag.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agents.core import Learner
from agents.counting import Counter
from agents.loggers import Logger, TerminalLogger

# loss_fn(params, batch) -> (loss, metrics dict)
LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]


class TrainingState(NamedTuple):
  params: Any
  opt_state: Any
  steps: jax.Array          # updates applied (the parameter version)


def make_update_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                     epochs: int = 1):
  """`epochs` gradient steps on one batch, as one pure function."""

  def one(state: TrainingState, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
    return TrainingState(params, opt_state, state.steps), metrics

  def update(state: TrainingState, batch):
    state, metrics = jax.lax.scan(lambda s, _: one(s, batch), state, None, length=epochs)
    metrics = jax.tree_util.tree_map(lambda m: m[-1], metrics)
    return state._replace(steps=state.steps + 1), metrics

  return update


class SGDLearner(Learner):
  """Steps `update` on batches of `iterator`; serves `policy` variables; saves and restores its
  `TrainingState` with the counter's counts."""

  def __init__(self, params, loss_fn: LossFn, optimizer: optax.GradientTransformation,
               iterator: Iterator[dict], *, epochs: int = 1, counter: Optional[Counter] = None,
               logger: Optional[Logger] = None,
               on_batch: Optional[Callable[[dict, int], tuple[dict, dict]]] = None):
    self._iterator = iterator
    self._update = jax.jit(make_update_step(loss_fn, optimizer, epochs))
    self._loss = jax.jit(lambda params, batch: loss_fn(params, batch)[0])
    self._state = TrainingState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
    self._counter = counter or Counter()
    self._logger = logger or TerminalLogger("learner", time_delta=10.0)
    self._on_batch = on_batch      # (batch, version) -> (batch, metrics): policy lag...
    self.last_metrics: dict = {}

  @property
  def version(self) -> int:
    return int(self._state.steps)

  @property
  def state(self) -> TrainingState:
    return self._state

  def step(self) -> dict:
    start = time.time()
    batch = next(self._iterator)
    extra = {}
    if self._on_batch:
      batch, extra = self._on_batch(batch, self.version)
    self._state, metrics = self._update(self._state, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    counts = self._counter.increment(steps=1, walltime=time.time() - start)
    self.last_metrics = {**metrics, **extra, **counts}
    self._logger.write(self.last_metrics)
    return self.last_metrics

  def loss(self, batch) -> float:
    """The loss of the current parameters on `batch` (no update)."""
    return float(self._loss(self._state.params, batch))

  def get_variables(self, names):
    return [self._state.params for _ in names]

  def save(self) -> dict:
    return {"state": jax.tree_util.tree_map(np.asarray, self._state),
            "counts": self._counter.save()}

  def restore(self, saved: dict) -> None:
    state = saved["state"]
    self._state = TrainingState(*jax.tree_util.tree_map(jnp.asarray, tuple(state)))
    self._counter.restore(saved["counts"])

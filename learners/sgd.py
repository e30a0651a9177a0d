"""A learner that minimises a loss on batches from an iterator with Optax (Acme's SGD learner).

The update is a pure function `(TrainingState, batch) -> (TrainingState, metrics)` jitted once;
only the learner object holds the state. The parameter version is the number of updates, so an
actor that records it with its data lets the learner measure policy lag.

With `ema_decay` > 0 the state also keeps an exponential moving average of the parameters
(Polyak averaging). Actors keep searching with the latest parameters; evaluation and inference
read the average, whose greedy choices do not flip with the noise of single updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agents.core import Learner
from agents.counting import Counter
from agents.loggers import Logger, TerminalLogger
from learners.checkpointing import CheckpointError

# loss_fn(params, batch) -> (loss, metrics dict)
LossFn = Callable[[Any, dict], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class SGDConfig:
  """What every learner's config has: the optimizer, the batches and the parameter average.
  An algorithm's config extends it (and may change its defaults)."""
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  max_gradient_norm: float = 1.0
  epochs: int = 1                  # gradient steps per batch
  batch_size: int = 16
  decay_steps: int = 0             # the rate falls along a cosine to 0 over these (0: constant)
  ema_decay: float = 0.0           # evaluation and propose read a moving average of the params

  def __post_init__(self):
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
    if self.decay_steps < 0:
      raise ValueError(f"decay_steps must be >= 0, got {self.decay_steps}")
    if self.epochs < 1 or self.batch_size < 1:
      raise ValueError("epochs and batch_size must be positive")


def make_optimizer(config: SGDConfig, pretrain_steps: int = 0,
                   pretrain_learning_rate: float = 0.0) -> optax.GradientTransformation:
  """AdamW after global-norm clipping; at `pretrain_learning_rate` during the first
  `pretrain_steps` updates where one is set, then at `learning_rate`, falling along a cosine to
  zero over `decay_steps` updates where one is set (the optimizer's own step count,
  checkpointed with it, drives the schedule, so a resumed run continues it)."""
  c = config
  boundary = pretrain_steps * c.epochs
  decay = c.decay_steps * c.epochs
  search = optax.cosine_decay_schedule(c.learning_rate, decay) if decay else None
  if boundary and (pretrain_learning_rate or decay):
    learning_rate = optax.join_schedules(
        [optax.constant_schedule(pretrain_learning_rate or c.learning_rate),
         search or optax.constant_schedule(c.learning_rate)], [boundary])
  else:   # a float where nothing changes: no schedule count in the optimizer state
    learning_rate = search or c.learning_rate
  return optax.chain(optax.clip_by_global_norm(c.max_gradient_norm),
                     optax.adamw(learning_rate, weight_decay=c.weight_decay))


@contextlib.contextmanager
def _signals_deferred():
  """SIGTERM and SIGINT wait until the block ends (a stop raised as KeyboardInterrupt halfway
  through would leave an update applied but not counted or logged, and a resumed run one
  update off in its logs). Python runs signal handlers in the main thread whichever thread
  the signal reached, so the block holds them with handlers of its own (a thread's signal
  mask would not: the signal goes to another thread of the process) and raises them again
  after it."""
  held: list[int] = []
  try:
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
  except ValueError:            # not the main thread: it gets no signals to defer
    yield
    return
  try:
    yield
  finally:
    for s, handler in previous.items():   # None: a handler installed outside Python
      signal.signal(s, signal.SIG_DFL if handler is None else handler)
    for s in dict.fromkeys(held):
      signal.raise_signal(s)


class TrainingState(NamedTuple):
  params: Any
  opt_state: Any
  steps: jax.Array          # updates applied (the parameter version)
  average: Any = None       # moving average of `params` (None: not kept)


def make_update_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                     epochs: int = 1, ema_decay: float = 0.0):
  """`epochs` gradient steps on one batch, then the parameter average, as one pure function."""

  def one(state: TrainingState, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
    return state._replace(params=params, opt_state=opt_state), metrics

  def update(state: TrainingState, batch):
    state, metrics = jax.lax.scan(lambda s, _: one(s, batch), state, None, length=epochs)
    metrics = jax.tree_util.tree_map(lambda m: m[-1], metrics)
    if ema_decay:
      state = state._replace(average=optax.incremental_update(state.params, state.average,
                                                              1.0 - ema_decay))
    return state._replace(steps=state.steps + 1), metrics

  return update


class SGDLearner(Learner):
  """Steps `update` on batches of `iterator`; serves `policy` variables; saves and restores its
  `TrainingState` with the counter's counts. Variables: "policy" (the latest parameters) and
  "average" (their moving average; the latest parameters where none is kept)."""

  def __init__(self, params, loss_fn: LossFn, optimizer: optax.GradientTransformation,
               iterator: Iterator[dict], *, epochs: int = 1, ema_decay: float = 0.0,
               counter: Optional[Counter] = None, logger: Optional[Logger] = None,
               on_batch: Optional[Callable[[dict, int], tuple[dict, dict]]] = None):
    if not 0.0 <= ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
    self._iterator = iterator
    self._ema_decay = ema_decay
    self._update = jax.jit(make_update_step(loss_fn, optimizer, epochs, ema_decay))
    self._loss = jax.jit(lambda params, batch: loss_fn(params, batch)[0])
    self._state = TrainingState(params, optimizer.init(params), jnp.zeros((), jnp.int32),
                                params if ema_decay else None)
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
    state, metrics = self._update(self._state, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    with _signals_deferred():   # the update, its count and its log row: all or none
      self._state = state
      counts = self._counter.increment(steps=1, walltime=time.time() - start)
      self.last_metrics = {**metrics, **extra, **counts}
      self._logger.write(self.last_metrics)
    return self.last_metrics

  def loss(self, batch) -> float:
    """The loss of the current parameters on `batch` (no update)."""
    return float(self._loss(self._state.params, batch))

  def get_variables(self, names):
    unknown = set(names) - {"policy", "average"}
    if unknown:
      raise KeyError(f"unknown variables {sorted(unknown)}; this learner has policy, average")
    state = self._state
    return [state.average if name == "average" and state.average is not None else state.params
            for name in names]

  def save(self) -> dict:
    return {"state": jax.tree_util.tree_map(np.asarray, self._state),
            "counts": self._counter.save()}

  def restore(self, saved: dict) -> None:
    """Restores a `save()`d state. Checkpoints keep containers, not their types (a NamedTuple
    comes back as a tuple), so each part is put back into the structure of this learner's own
    state, leaf by leaf, and must fit it."""
    params, opt_state, steps, *rest = saved["state"]
    average = rest[0] if rest else None
    mine = self._state

    def fit(template, tree, what):
      leaves = jax.tree_util.tree_leaves(tree)
      want = jax.tree_util.tree_leaves(template)
      if len(leaves) != len(want) or any(np.shape(a) != np.shape(b)
                                         for a, b in zip(leaves, want)):
        raise CheckpointError(f"the checkpoint's {what} does not fit this learner (another "
                              "network or optimizer?)")
      return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template),
                                          [jnp.asarray(x) for x in leaves])

    params = fit(mine.params, params, "parameters")
    if not self._ema_decay:
      average = None
    elif average is None:    # a run that kept no average until now
      average = params
    else:
      average = fit(mine.params, average, "parameter average")
    self._state = TrainingState(params, fit(mine.opt_state, opt_state, "optimizer state"),
                                jnp.asarray(steps), average)
    self._counter.restore(saved["counts"])

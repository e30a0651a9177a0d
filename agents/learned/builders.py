"""Builders (Acme's layout): everything a run needs, made the same way whether the pieces live
in one process (tests) or in separate processes on several machines (`shardzero train`).

A builder knows its algorithm's replay tables, adder, dataset iterator, actor, learner and
policy. Reverb is imported only by the methods that need it, so a policy can be loaded and
played without TensorFlow.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import Any, Iterator

import jax
import numpy as np
import optax
import tree

from agents.core import Actor, VariableSource
from agents.learned import networks as networks_lib
from agents.learned.actors import AlphaZeroActor, PolicyActor, make_policy
from agents.learned.variable_client import AVERAGE_TABLE, PARAMS_TABLE, VariableClient
from environments.observations import Sizes, observation_spec
from learners.alphazero import AlphaZeroConfig, alphazero_loss
from learners.ppo import PPOConfig, ppo_loss
from learners.sgd import SGDLearner

TRAJECTORY_TABLE = "trajectories"


class ReverbIterator:
  """Batches of `batch_size` items sampled from a table, unflattened like `template` and
  stacked along a new leading axis."""

  def __init__(self, client, table: str, batch_size: int, template):
    self._client, self._table = client, table
    self._batch_size = batch_size
    self._template = template

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    # Reverb's sample call blocks in C++ (for ever once its server is gone), where a stop
    # signal's Python handler cannot run; it runs in a thread, and the caller waits on it in
    # Python, so SIGTERM still stops (and checkpoints) a learner waiting for data.
    done: dict = {}

    def sample():
      try:
        items = [tree.unflatten_as(self._template, [np.asarray(x) for x in s.data])
                 for s in self._client.sample(self._table, num_samples=self._batch_size,
                                              emit_timesteps=False)]
        done["batch"] = tree.map_structure(lambda *xs: np.stack(xs), *items)
      except Exception as e:   # noqa: BLE001 - raised again in the caller's thread
        done["error"] = e

    worker = threading.Thread(target=sample, name="reverb-sample", daemon=True)
    worker.start()
    while worker.is_alive():
      worker.join(timeout=1.0)
    if "error" in done:
      raise done["error"]
    return done["batch"]


def _policy_lag(batch: dict, version: int) -> tuple[dict, dict]:
  """Drops the versions from the batch; reports how many updates old the data was."""
  batch = dict(batch)
  versions = np.asarray(batch.pop("version"))
  first = versions[:, 0] if versions.ndim > 1 else versions
  return batch, {"policy_lag": float(version - first.mean())}


class Builder(abc.ABC):
  """The pieces of one learning algorithm over observations padded to `sizes`."""

  def __init__(self, config, sizes: Sizes,
               network_config: networks_lib.NetworkConfig = networks_lib.NetworkConfig()):
    self.config = config
    self.sizes = Sizes(*sizes)
    self.network_config = network_config

  def make_networks(self) -> networks_lib.Networks:
    return networks_lib.make_networks(self.network_config)

  def dummy_observation(self) -> dict:
    return {k: s.generate_value() for k, s in observation_spec(self.sizes).items()}

  def init_params(self, networks, seed: int = 0):
    return networks.init(jax.random.PRNGKey(seed), self.dummy_observation())

  def params_treedef(self, networks):
    return jax.tree_util.tree_structure(self.init_params(networks))

  @abc.abstractmethod
  def item_template(self) -> dict:
    """The structure (and dtypes) of one replay item's step."""

  @abc.abstractmethod
  def make_replay_tables(self) -> list:
    """The trajectory table and the parameter table (reverb.Table objects)."""

  @abc.abstractmethod
  def make_adder(self, client):
    ...

  @abc.abstractmethod
  def make_actor(self, environment, networks, variable_source: VariableSource, adder=None,
                 seed: int = 0, evaluation: bool = False) -> Actor:
    ...

  @abc.abstractmethod
  def loss(self, networks):
    ...

  def make_dataset_iterator(self, client) -> Iterator[dict]:
    return ReverbIterator(client, TRAJECTORY_TABLE, self.config.batch_size, self.item_template())

  def make_optimizer(self) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; at `pretrain_learning_rate` during the cloning
    updates where one is set, then at `learning_rate`, falling along a cosine to zero over
    `decay_steps` updates where one is set (the optimizer's own step count, checkpointed with
    it, drives the schedule, so a resumed run continues it)."""
    c = self.config
    boundary = getattr(c, "pretrain_steps", 0) * c.epochs
    decay = getattr(c, "decay_steps", 0) * c.epochs
    pretrain_rate = getattr(c, "pretrain_learning_rate", 0.0)
    search = optax.cosine_decay_schedule(c.learning_rate, decay) if decay else None
    if boundary and (pretrain_rate or decay):
      learning_rate = optax.join_schedules(
          [optax.constant_schedule(pretrain_rate or c.learning_rate),
           search or optax.constant_schedule(c.learning_rate)], [boundary])
    else:   # a float where nothing changes: no schedule count in the optimizer state
      learning_rate = search or c.learning_rate
    return optax.chain(optax.clip_by_global_norm(c.max_gradient_norm),
                       optax.adamw(learning_rate, weight_decay=getattr(c, "weight_decay", 0.0)))

  def make_learner(self, networks, params, iterator, counter=None, logger=None) -> SGDLearner:
    return SGDLearner(params, self.loss(networks), self.make_optimizer(), iterator,
                      epochs=self.config.epochs, ema_decay=self.config.ema_decay,
                      counter=counter, logger=logger, on_batch=_policy_lag)

  def make_policy(self, networks, evaluation: bool = False):
    return make_policy(networks, evaluation)

  @property
  def evaluation_variables(self) -> str:
    """What the evaluator and `propose` play: the parameter average if the learner keeps one."""
    return "average" if self.config.ema_decay else "policy"

  @staticmethod
  def _params_tables() -> list:
    """One-item tables with the latest parameters and with their moving average."""
    import reverb
    return [reverb.Table(name, sampler=reverb.selectors.Uniform(),
                         remover=reverb.selectors.Fifo(), max_size=1,
                         rate_limiter=reverb.rate_limiters.MinSize(1))
            for name in (PARAMS_TABLE, AVERAGE_TABLE)]


class PPOBuilder(Builder):
  """On-policy: a queue of sequences; actors block when the learner falls behind."""

  def __init__(self, config: PPOConfig = PPOConfig(), sizes: Sizes = Sizes(4096, 8192, 512),
               network_config=networks_lib.NetworkConfig()):
    super().__init__(config, sizes, network_config)

  def item_template(self) -> dict:
    return {"observation": self.dummy_observation(), "action": np.int32(0),
            "reward": np.float32(0), "discount": np.float32(0), "valid": np.float32(0),
            "log_prob": np.float32(0), "version": np.int64(0)}

  def make_replay_tables(self) -> list:
    import reverb
    return [reverb.Table.queue(TRAJECTORY_TABLE, self.config.queue_size), *self._params_tables()]

  def make_adder(self, client):
    from agents.learned.reverb_adders import SequenceAdder
    return SequenceAdder(client, TRAJECTORY_TABLE, self.config.sequence_length)

  def make_actor(self, environment, networks, variable_source, adder=None, seed=0,
                 evaluation=False, update_period: int = 1):
    return PolicyActor(self.make_policy(networks, evaluation),
                       VariableClient(variable_source, update_period), adder, seed)

  def loss(self, networks):
    return ppo_loss(networks, self.config)


class AlphaZeroBuilder(Builder):
  """Off-policy: uniform replay of search targets, sampled about `samples_per_insert` times
  each (a rate limiter keeps learner and actors in step)."""

  def __init__(self, config: AlphaZeroConfig = AlphaZeroConfig(),
               sizes: Sizes = Sizes(4096, 8192, 512), network_config=networks_lib.NetworkConfig()):
    super().__init__(config, sizes, network_config)

  def item_template(self) -> dict:
    return {"observation": self.dummy_observation(),
            "visits": np.zeros(self.sizes.actions, np.float32), "version": np.int64(0),
            "return": np.float32(0)}

  def make_replay_tables(self) -> list:
    import reverb
    c = self.config
    limiter = reverb.rate_limiters.SampleToInsertRatio(
        samples_per_insert=c.samples_per_insert, min_size_to_sample=c.min_replay_size,
        error_buffer=max(c.batch_size * 4.0, c.samples_per_insert * c.min_replay_size))
    table = reverb.Table(TRAJECTORY_TABLE, sampler=reverb.selectors.Uniform(),
                         remover=reverb.selectors.Fifo(), max_size=c.replay_size,
                         rate_limiter=limiter)
    return [table, *self._params_tables()]

  def make_adder(self, client):
    from agents.learned.reverb_adders import ReturnAdder
    return ReturnAdder(client, TRAJECTORY_TABLE)

  def make_actor(self, environment, networks, variable_source, adder=None, seed=0,
                 evaluation=False, update_period: int = 1):
    c = self.config
    return AlphaZeroActor(environment, networks, VariableClient(variable_source, update_period),
                          adder, simulations=c.simulations, temperature=c.temperature,
                          prior_mix=0.0 if evaluation else c.prior_mix,
                          evaluation=evaluation, seed=seed,
                          demonstrations=0.0 if evaluation else c.demonstrations,
                          policy_target=c.policy_target,
                          demonstration_search=c.demonstration_search)

  def loss(self, networks):
    return alphazero_loss(networks, self.config)


ALGORITHMS = {"ppo": (PPOBuilder, PPOConfig), "alphazero": (AlphaZeroBuilder, AlphaZeroConfig)}


def _typed(algorithm: str, field: dataclasses.Field, value):
  """A setting's value checked against the type of its default (an int is a float too)."""
  from partitioner.errors import ShardzeroError
  default = field.default
  if default is dataclasses.MISSING or default is None or value is None:
    return value
  kind = type(default)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    article = "an" if kind.__name__[0] in "aeiou" else "a"
    raise ShardzeroError(f"{algorithm} setting {field.name} takes {article} {kind.__name__} "
                         f"(like {default!r}), got {value!r}")
  return value


def make_builder(algorithm: str, config: dict | None = None, sizes=Sizes(4096, 8192, 512),
                 network: dict | None = None) -> Builder:
  """A builder by name with config overrides (what `shardzero train` saves in a run)."""
  from partitioner.errors import ShardzeroError
  if algorithm not in ALGORITHMS:
    raise ShardzeroError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
  builder_cls, config_cls = ALGORITHMS[algorithm]
  fields = {f.name for f in dataclasses.fields(config_cls)}
  unknown = set(config or {}) - fields
  if unknown:
    raise ShardzeroError(f"unknown {algorithm} settings {sorted(unknown)}; "
                         f"known: {', '.join(sorted(fields))}")
  config = {f.name: _typed(algorithm, f, (config or {})[f.name])
            for f in dataclasses.fields(config_cls) if f.name in (config or {})}
  try:
    algorithm_config = config_cls(**config)
  except ValueError as e:
    raise ShardzeroError(f"bad {algorithm} settings: {e}") from None
  return builder_cls(algorithm_config, Sizes(*sizes),
                     networks_lib.NetworkConfig(**(network or {})))


def asdict(builder: Builder) -> dict[str, Any]:
  name = {v[0]: k for k, v in ALGORITHMS.items()}[type(builder)]
  return {"algorithm": name, "config": dataclasses.asdict(builder.config),
          "sizes": list(builder.sizes), "network": dataclasses.asdict(builder.network_config)}

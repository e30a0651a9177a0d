"""Builders (Acme's layout): everything a run needs, made the same way whether the pieces live
in one process (tests) or in separate processes on several machines (`shardzero train`).

A builder knows its algorithm's replay tables, adder, dataset iterator, actor, learner and
policy; `learners.ppo.builder` and `learners.alphazero.builder` are the two, and
`learners.algorithms` makes one by name from a run's settings. Reverb is imported only by the
methods that need it, so a policy can be loaded and played without TensorFlow.
"""

from __future__ import annotations

import abc
import threading
from typing import Iterator

import jax
import numpy as np
import optax
import tree

from agents import networks as networks_lib
from agents.core import Actor, VariableSource
from agents.variable_client import AVERAGE_TABLE, PARAMS_TABLE
from environments.observations import DEFAULT_SIZES, Sizes, observation_spec
from learners.sgd import SGDConfig, SGDLearner, make_optimizer

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
  """The pieces of one learning algorithm over observations padded to `sizes`: `config` is the
  learner's settings, `actor_config` the actor's."""

  def __init__(self, config: SGDConfig, actor_config, sizes: Sizes = DEFAULT_SIZES,
               network_config: networks_lib.NetworkConfig = networks_lib.NetworkConfig()):
    self.config = config
    self.actor_config = actor_config
    self.sizes = Sizes(*sizes)
    self.network_config = network_config

  @property
  def pretraining(self) -> tuple[int, float]:
    """(updates that clone demonstrations before the actors' data is read, their learning
    rate, 0 for the config's): none by default."""
    return 0, 0.0

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
                 seed: int = 0, evaluation: bool = False, update_period: int = 1) -> Actor:
    ...

  @abc.abstractmethod
  def loss(self, networks):
    ...

  def make_dataset_iterator(self, client) -> Iterator[dict]:
    return ReverbIterator(client, TRAJECTORY_TABLE, self.config.batch_size, self.item_template())

  def make_optimizer(self) -> optax.GradientTransformation:
    return make_optimizer(self.config, *self.pretraining)

  def make_learner(self, networks, params, iterator, counter=None, logger=None) -> SGDLearner:
    return SGDLearner(params, self.loss(networks), self.make_optimizer(), iterator,
                      epochs=self.config.epochs, ema_decay=self.config.ema_decay,
                      counter=counter, logger=logger, on_batch=_policy_lag)

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

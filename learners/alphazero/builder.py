"""AlphaZero's builder: uniform, rate-limited replay of search targets."""

from __future__ import annotations

import numpy as np

from agents import networks as networks_lib
from agents.alphazero.acting import AlphaZeroActor
from agents.alphazero.config import AlphaZeroActorConfig
from agents.variable_client import VariableClient
from environments.observations import DEFAULT_SIZES, Sizes
from learners.alphazero.config import AlphaZeroConfig
from learners.alphazero.losses import alphazero_loss
from learners.builders import TRAJECTORY_TABLE, Builder


class AlphaZeroBuilder(Builder):
  """Off-policy: uniform replay of search targets, sampled about `samples_per_insert` times
  each (a rate limiter keeps learner and actors in step)."""

  def __init__(self, config: AlphaZeroConfig = AlphaZeroConfig(),
               actor_config: AlphaZeroActorConfig = AlphaZeroActorConfig(),
               sizes: Sizes = DEFAULT_SIZES, network_config=networks_lib.NetworkConfig()):
    super().__init__(config, actor_config, sizes, network_config)

  @property
  def pretraining(self) -> tuple[int, float]:
    return self.config.pretrain_steps, self.config.pretrain_learning_rate

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
    from agents.reverb_adders import ReturnAdder
    return ReturnAdder(client, TRAJECTORY_TABLE)

  def make_actor(self, environment, networks, variable_source, adder=None, seed=0,
                 evaluation=False, update_period: int = 1):
    return AlphaZeroActor(environment, networks, VariableClient(variable_source, update_period),
                          adder, self.actor_config, evaluation=evaluation, seed=seed)

  def loss(self, networks):
    return alphazero_loss(networks, self.config)

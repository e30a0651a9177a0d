"""PPO's builder: a queue of sequences between actors and learner."""

from __future__ import annotations

import numpy as np

from agents import networks as networks_lib
from agents.ppo.acting import PolicyActor
from agents.ppo.config import PPOActorConfig
from agents.ppo.networks import make_policy
from agents.variable_client import VariableClient
from environments.observations import DEFAULT_SIZES, Sizes
from learners.builders import TRAJECTORY_TABLE, Builder
from learners.ppo.config import PPOConfig


class PPOBuilder(Builder):
  """On-policy: a queue of sequences; actors block when the learner falls behind."""

  def __init__(self, config: PPOConfig = PPOConfig(),
               actor_config: PPOActorConfig = PPOActorConfig(), sizes: Sizes = DEFAULT_SIZES,
               network_config=networks_lib.NetworkConfig()):
    super().__init__(config, actor_config, sizes, network_config)

  def item_template(self) -> dict:
    return {"observation": self.dummy_observation(), "action": np.int32(0),
            "reward": np.float32(0), "discount": np.float32(0), "valid": np.float32(0),
            "log_prob": np.float32(0), "version": np.int64(0)}

  def make_replay_tables(self) -> list:
    import reverb
    return [reverb.Table.queue(TRAJECTORY_TABLE, self.config.queue_size), *self._params_tables()]

  def make_adder(self, client):
    from agents.reverb_adders import SequenceAdder
    return SequenceAdder(client, TRAJECTORY_TABLE, self.actor_config.sequence_length)

  def make_actor(self, environment, networks, variable_source, adder=None, seed=0,
                 evaluation=False, update_period: int = 1):
    return PolicyActor(make_policy(networks, evaluation),
                       VariableClient(variable_source, update_period), adder, seed)

  def loss(self, networks):
    from learners.ppo.losses import ppo_loss   # rlax: the `train` extra, not needed to play
    return ppo_loss(networks, self.config)

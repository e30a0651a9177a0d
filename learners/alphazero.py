"""AlphaZero-style learning: fit the policy to the search's visit distribution and the value to
the return that followed.

An actor searches with MCTS guided by the network's prior and value at every step; it records
the normalised visit counts of the root, or the prior improved by its completed Q-values
(one-hot finish when the search found nothing better than stopping), and at the end of the
episode the return from that step on. The learner samples these steps uniformly
(rate-limited against insertion) and minimises cross-entropy to the policy target plus the
squared value error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from agents.learned.networks import Networks


POLICY_TARGETS = ("completed_q", "visits")


@dataclasses.dataclass(frozen=True)
class AlphaZeroConfig:
  learning_rate: float = 1e-3
  weight_decay: float = 1e-4
  value_cost: float = 0.5
  max_gradient_norm: float = 1.0
  return_clip: float = 4.0         # value targets are clipped to +-return_clip
  epochs: int = 1
  batch_size: int = 16             # steps per batch
  simulations: int = 16            # MCTS simulations per move
  temperature: float = 1.0         # actors sample moves from visits^(1/temperature)
  policy_target: str = "visits"    # or "completed_q" (Gumbel MuZero's): see AlphaZeroActor
  prior_mix: float = 0.25          # actors search with this share of the heuristic prior
  demonstrations: float = 0.0      # share of actor episodes that replay the best known strategy
  demonstration_search: int = 0    # plain MCTS simulations per train task that may beat its
                                   # best expert as the demonstration (0: experts only)
  pretrain_steps: int = 0          # first updates clone the experts of the train split
  pretrain_learning_rate: float = 0.0  # during those updates (0: learning_rate)
  decay_steps: int = 0             # after them the rate falls along a cosine to 0 (0: constant)
  replay_size: int = 2000
  samples_per_insert: float = 4.0  # how often each step is used, on average
  min_replay_size: int = 32
  ema_decay: float = 0.0           # evaluation and propose read a moving average of the params

  def __post_init__(self):
    if self.policy_target not in POLICY_TARGETS:
      raise ValueError(f"unknown policy_target {self.policy_target!r}; "
                       f"choose from {', '.join(POLICY_TARGETS)}")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
    if self.pretrain_learning_rate < 0:
      raise ValueError(f"pretrain_learning_rate must be >= 0, got {self.pretrain_learning_rate}")
    if self.demonstration_search < 0:
      raise ValueError(f"demonstration_search must be >= 0, got {self.demonstration_search}")
    if self.decay_steps < 0:
      raise ValueError(f"decay_steps must be >= 0, got {self.decay_steps}")


def alphazero_loss(networks: Networks, config: AlphaZeroConfig):
  """loss_fn(params, batch) -> (loss, metrics)."""

  def loss_fn(params, batch):
    out = networks.apply(params, batch["observation"])
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    visits = batch["visits"]
    policy_loss = -jnp.mean(jnp.sum(jnp.where(visits > 0, visits * logp, 0.0), axis=-1))
    value_loss = 0.5 * jnp.mean((out.value - jnp.clip(batch["return"], -config.return_clip,
                                                   config.return_clip)) ** 2)
    agreement = jnp.mean(jnp.argmax(out.logits, -1) == jnp.argmax(visits, -1))
    loss = policy_loss + config.value_cost * value_loss
    return loss, {"policy_loss": policy_loss, "value_loss": value_loss,
                  "argmax_agreement": agreement}

  return loss_fn

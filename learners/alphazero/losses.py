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

import chex
import jax
import jax.numpy as jnp

from agents.networks import Networks
from learners.alphazero.config import AlphaZeroConfig


def alphazero_loss(networks: Networks, config: AlphaZeroConfig):
  """loss_fn(params, batch) -> (loss, metrics)."""

  def loss_fn(params, batch):
    visits = batch["visits"]
    chex.assert_rank(visits, 2)                                          # [B, A]
    chex.assert_shape(batch["return"], visits.shape[:1])
    out = networks.apply(params, batch["observation"])
    chex.assert_equal_shape([out.logits, visits])
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    policy_loss = -jnp.mean(jnp.sum(jnp.where(visits > 0, visits * logp, 0.0), axis=-1))
    value_loss = 0.5 * jnp.mean((out.value - jnp.clip(batch["return"], -config.return_clip,
                                                   config.return_clip)) ** 2)
    agreement = jnp.mean(jnp.argmax(out.logits, -1) == jnp.argmax(visits, -1))
    loss = policy_loss + config.value_cost * value_loss
    return loss, {"policy_loss": policy_loss, "value_loss": value_loss,
                  "argmax_agreement": agreement}

  return loss_fn

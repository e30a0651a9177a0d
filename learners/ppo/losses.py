"""PPO (Schulman et al. 2017) on sequences of the partitioning environment.

A batch holds `[B, T+1]` steps from the sequence adder: the observation, the action taken, the
reward and discount that followed, the behaviour policy's log-probability of the action, and
`valid` (0 on the step after the episode's last action and on padding). Values are recomputed
with the current parameters; GAE (rlax) is cut where the next step is not valid, so a sequence
that holds the end of an episode bootstraps from the final observation (truncation) or not at
all (termination, discount 0). Rewards are clipped to +-`reward_clip`: an episode far over
the memory budget would otherwise swamp the value loss.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import rlax

from agents.networks import Networks, masked_entropy
from learners.ppo.config import PPOConfig


def ppo_loss(networks: Networks, config: PPOConfig):
  """loss_fn(params, batch) -> (loss, metrics)."""

  def loss_fn(params, batch):
    chex.assert_rank(batch["action"], 2)                                 # [B, T+1]
    chex.assert_equal_shape([batch["action"], batch["reward"], batch["discount"],
                             batch["valid"], batch["log_prob"]])
    out = networks.apply(params, batch["observation"])
    chex.assert_shape(out.value, batch["action"].shape)
    logp_all = jax.nn.log_softmax(out.logits, axis=-1)                   # [B, T+1, A]
    values = out.value                                                   # [B, T+1]
    valid = batch["valid"][:, :-1]
    lam = config.gae_lambda * batch["valid"][:, 1:]
    discount = config.discount * batch["discount"][:, :-1]
    advantages = jax.vmap(rlax.truncated_generalized_advantage_estimation)(
        jnp.clip(batch["reward"][:, :-1], -config.reward_clip, config.reward_clip), discount,
        lam, values)
    advantages = jax.lax.stop_gradient(advantages)
    targets = advantages + jax.lax.stop_gradient(values[:, :-1])
    count = jnp.maximum(valid.sum(), 1.0)
    mean = (advantages * valid).sum() / count
    std = jnp.sqrt((((advantages - mean) * valid) ** 2).sum() / count + 1e-8)
    normalised = (advantages - mean) / std * valid
    action = batch["action"][:, :-1]
    logp = jnp.take_along_axis(logp_all[:, :-1], action[..., None], axis=-1)[..., 0]
    ratio = jnp.exp(jnp.where(valid > 0, logp - batch["log_prob"][:, :-1], 0.0))
    pg = rlax.clipped_surrogate_pg_loss(ratio.reshape(-1), normalised.reshape(-1),
                                        config.clip_epsilon) * valid.size / count
    value_loss = 0.5 * (((values[:, :-1] - targets) ** 2) * valid).sum() / count
    entropy = (masked_entropy(out.logits[:, :-1]) * valid).sum() / count
    loss = pg + config.value_cost * value_loss - config.entropy_cost * entropy
    clipped = ((jnp.abs(ratio - 1) > config.clip_epsilon) * valid).sum() / count
    return loss, {"policy_loss": pg, "value_loss": value_loss, "entropy": entropy,
                  "clip_fraction": clipped, "advantage_mean": mean}

  return loss_fn

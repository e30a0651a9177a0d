"""A Mixture-of-Experts decoder training step (GShard/Switch style): every other block's
feed-forward is a set of experts chosen per token by a top-k router, with a fixed capacity
per expert and sequence (tokens over capacity are dropped), dispatch and combine written as
one-hot einsums, and the load-balancing auxiliary loss. Expert weights carry a leading
expert dimension, which is what expert parallelism splits."""

from __future__ import annotations

import dataclasses
import math

import haiku as hk
import jax
import jax.numpy as jnp

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  experts: int = 4
  top_k: int = 2
  capacity_factor: float = 1.25
  moe_every: int = 2       # every n-th block (the last of each n) is a MoE block
  vocab: int = 256
  seq: int = 16
  batch: int = 8
  aux_weight: float = 0.01
  remat: bool = False
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": MoEConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": MoEConfig(layers=2, d_model=1024, heads=16, experts=8, vocab=32768, seq=256, batch=64),
    "base": MoEConfig(layers=12, d_model=768, heads=12, experts=32, vocab=50304, seq=1024,
                      batch=256, remat=True),
    "large": MoEConfig(layers=24, d_model=1024, heads=16, experts=64, vocab=50304, seq=1024,
                       batch=256, remat=True),
}


class MoEFeedForward(hk.Module):
  """Top-k routed experts; returns (output, load-balancing loss)."""

  def __init__(self, c: MoEConfig, name: str | None = None):
    super().__init__(name=name)
    self.c = c

  def __call__(self, x):
    c = self.c
    b, s, d = x.shape
    e, k, hidden = c.experts, c.top_k, c.ffn_mult * d
    capacity = max(1, math.ceil(c.capacity_factor * s * k / e))
    probs = jax.nn.softmax(hk.Linear(e, name="router")(x))                  # [b, s, e]
    gates, index = jax.lax.top_k(probs, k)                                  # [b, s, k]
    chosen = jax.nn.one_hot(index, e)                                       # [b, s, k, e]
    # Buffer position of each (token, choice): first choices of all tokens come first.
    order = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, e)
    position = (jnp.cumsum(order, axis=1) - 1.0) * order
    position = position.reshape(b, k, s, e).transpose(0, 2, 1, 3)          # [b, s, k, e]
    kept = chosen * (position < capacity)
    slot = jax.nn.one_hot(position.sum(-1), capacity)                       # [b, s, k, cap]
    dispatch = jnp.einsum("bske,bskc->bsec", kept, slot)
    combine = jnp.einsum("bske,bskc,bsk->bsec", kept, slot, gates)
    init = hk.initializers.VarianceScaling(1.0, "fan_avg", "truncated_normal")
    w_in = hk.get_parameter("w_in", [e, d, hidden], init=init)
    w_out = hk.get_parameter("w_out", [e, hidden, d], init=init)
    expert_in = jnp.einsum("bsec,bsd->becd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("becd,edh->bech", expert_in, w_in))
    expert_out = jnp.einsum("bech,ehd->becd", h, w_out)
    y = jnp.einsum("bsec,becd->bsd", combine, expert_out)
    fraction = chosen[:, :, 0].mean(axis=(0, 1))                            # top-1 load
    aux = e * jnp.sum(fraction * probs.mean(axis=(0, 1)))
    return y, aux


def block(x, *, c, experts: bool, causal: bool = True):
  """A pre-LN block whose feed-forward is routed experts or dense; returns (x, aux loss)."""
  x = x + L.Attention(c.heads, causal=causal, name="attn")(L.layer_norm("ln1")(x))
  h = L.layer_norm("ln2")(x)
  if experts:
    y, aux = MoEFeedForward(c, name="experts")(h)
  else:
    y, aux = L.mlp(h, c.ffn_mult * c.d_model), jnp.zeros(())
  return x + y, aux


def _forward(c: MoEConfig):
  def forward(tokens):
    with hk.name_scope("moe"):
      embed = hk.Embed(c.vocab, c.d_model, name="embed", w_init=L.truncated())
      pos = hk.get_parameter("pos_embed", [c.seq, c.d_model], init=L.truncated())
      x = embed(tokens) + pos[: tokens.shape[1]]
      aux = 0.0
      for i in range(c.layers):
        with hk.name_scope(f"layer_{i}"):
          x, a = L.checkpointed(block, c.remat, c=c, experts=(i + 1) % c.moe_every == 0)(x)
          aux = aux + a
      x = L.layer_norm("ln_f")(x)
      return x @ embed.embeddings.T, aux
  return hk.without_apply_rng(hk.transform(forward))


def make(config):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  return L.next_token_step(_forward(config), config, config.aux_weight)

"""A GPT-style decoder training step: causal attention, pre-LayerNorm, tied embeddings,
integer-label cross-entropy, global-norm clipping and Adam."""

from __future__ import annotations

import dataclasses
import math

import haiku as hk
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  vocab: int = 256
  seq: int = 16
  batch: int = 8
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": GPTConfig(),
    "125m": GPTConfig(layers=12, d_model=768, heads=12, vocab=50304, seq=1024, batch=64),
    "350m": GPTConfig(layers=24, d_model=1024, heads=16, vocab=50304, seq=1024, batch=64),
    "1.3b": GPTConfig(layers=24, d_model=2048, heads=32, vocab=50304, seq=2048, batch=64),
    "6.7b": GPTConfig(layers=32, d_model=4096, heads=32, vocab=50304, seq=2048, batch=64),
}


class Attention(hk.Module):
  def __init__(self, heads: int, name: str | None = None):
    super().__init__(name=name)
    self.heads = heads

  def __call__(self, x):
    b, s, d = x.shape
    h = self.heads
    split = lambda t: t.reshape(b, s, h, d // h)
    q = split(hk.Linear(d, name="query")(x))
    k = split(hk.Linear(d, name="key")(x))
    v = split(hk.Linear(d, name="value")(x))
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d // h)
    causal = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(causal, logits, -1e9)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhst,bthd->bshd", weights, v).reshape(b, s, d)
    return hk.Linear(d, name="out")(out)


def _forward(config: GPTConfig):
  def forward(tokens):
    with hk.name_scope("gpt"):
      embed = hk.Embed(config.vocab, config.d_model, name="embed",
                       w_init=hk.initializers.TruncatedNormal(0.02))
      pos = hk.get_parameter("pos_embed", [config.seq, config.d_model],
                             init=hk.initializers.TruncatedNormal(0.02))
      x = embed(tokens) + pos[: tokens.shape[1]]
      for i in range(config.layers):
        with hk.name_scope(f"layer_{i}"):
          ln = lambda n: hk.LayerNorm(-1, create_scale=True, create_offset=True, name=n)
          x = x + Attention(config.heads, name="attn")(ln("ln1")(x))
          h = jax.nn.gelu(hk.Linear(config.ffn_mult * config.d_model, name="w_in")(ln("ln2")(x)))
          x = x + hk.Linear(config.d_model, name="w_out")(h)
      x = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln_f")(x)
      return x @ embed.embeddings.T
  return hk.without_apply_rng(hk.transform(forward))


def make(config: GPTConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(config.lr))

  def loss_fn(params, batch):
    logits = net.apply(params, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def init(key):
    kt, kp = jax.random.split(key)
    tokens = jax.random.randint(kt, (config.batch, config.seq + 1), 0, config.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = net.init(kp, batch["inputs"])
    return params, opt.init(params), batch

  return train_step, init

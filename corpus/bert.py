"""A BERT-style encoder with a masked-LM head: bidirectional post-LayerNorm blocks, token and
position embeddings, a transform + tied-decoder head, cross-entropy on the masked positions
only (a weight per position), and AdamW."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class BERTConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  vocab: int = 256
  seq: int = 16
  batch: int = 8
  mask_rate: float = 0.15
  remat: bool = False
  lr: float = 1e-4
  seed: int = 0


PRESETS = {
    "small": BERTConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": BERTConfig(layers=2, d_model=1024, heads=16, vocab=30528, seq=256, batch=64),
    "base": BERTConfig(layers=12, d_model=768, heads=12, vocab=30528, seq=512, batch=256,
                       remat=True),
    "large": BERTConfig(layers=24, d_model=1024, heads=16, vocab=30528, seq=512, batch=256,
                        remat=True),
}


def _post_ln_block(x, *, heads, hidden):
  x = L.layer_norm("ln1")(x + L.Attention(heads, name="attn")(x))
  return L.layer_norm("ln2")(x + L.mlp(x, hidden))


def _forward(c: BERTConfig):
  def forward(tokens):
    with hk.name_scope("bert"):
      embed = hk.Embed(c.vocab, c.d_model, name="embed", w_init=L.truncated())
      pos = hk.get_parameter("pos_embed", [c.seq, c.d_model], init=L.truncated())
      x = L.layer_norm("ln_embed")(embed(tokens) + pos)
      for i in range(c.layers):
        with hk.name_scope(f"layer_{i}"):  # post-LN, as in BERT
          x = L.checkpointed(_post_ln_block, c.remat, heads=c.heads,
                             hidden=c.ffn_mult * c.d_model)(x)
      with hk.name_scope("mlm"):
        h = L.layer_norm("ln")(jax.nn.gelu(hk.Linear(c.d_model, name="transform")(x)))
        bias = hk.get_parameter("bias", [c.vocab], init=jnp.zeros)
        return h @ embed.embeddings.T + bias
  return hk.without_apply_rng(hk.transform(forward))


def make(config: BERTConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(config.lr, weight_decay=0.01))

  def loss_fn(params, batch):
    logits = net.apply(params, batch["inputs"])
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = batch["weights"]
    return (xent * weights).sum() / jnp.maximum(weights.sum(), 1.0)

  def init(key):
    kt, km, kp = jax.random.split(key, 3)
    targets = L.tokens(kt, config.batch, config.seq, config.vocab)
    masked = jax.random.bernoulli(km, config.mask_rate, targets.shape)
    batch = {"inputs": jnp.where(masked, 0, targets), "targets": targets,
             "weights": masked.astype(jnp.float32)}
    params = net.init(kp, batch["inputs"])
    return params, opt.init(params), batch

  return L.train_step_for(loss_fn, opt), init

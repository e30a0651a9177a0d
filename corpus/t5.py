"""A T5-style encoder-decoder training step: a bidirectional encoder, a causal decoder with
cross-attention, one embedding shared by both and by the output layer, ReLU feed-forward,
teacher-forced cross-entropy and Adam. Positions are learned absolute embeddings rather than
T5's relative bias, which changes no shapes that matter for partitioning."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import optax

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class T5Config:
  layers: int = 2          # per stack (encoder and decoder each)
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  vocab: int = 256
  src_seq: int = 16
  tgt_seq: int = 8
  batch: int = 8
  remat: bool = False
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": T5Config(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": T5Config(layers=2, d_model=1024, heads=16, vocab=32128, src_seq=256, tgt_seq=64, batch=32),
    "base": T5Config(layers=12, d_model=768, heads=12, vocab=32128, src_seq=512, tgt_seq=128,
                     batch=128, remat=True),
    "large": T5Config(layers=24, d_model=1024, heads=16, vocab=32128, src_seq=512, tgt_seq=128,
                      batch=128, remat=True),
    "3b": T5Config(layers=24, d_model=1024, heads=32, ffn_mult=16, vocab=32128, src_seq=512,
                   tgt_seq=128, batch=128, remat=True),
}


def _forward(c: T5Config):
  def forward(src, tgt_in):
    with hk.name_scope("t5"):
      embed = hk.Embed(c.vocab, c.d_model, name="embed", w_init=L.truncated())
      enc_pos = hk.get_parameter("enc_pos", [c.src_seq, c.d_model], init=L.truncated())
      dec_pos = hk.get_parameter("dec_pos", [c.tgt_seq, c.d_model], init=L.truncated())
      hidden = c.ffn_mult * c.d_model
      x = embed(src) + enc_pos
      for i in range(c.layers):
        with hk.name_scope(f"encoder_{i}"):
          x = L.checkpointed(L.pre_ln_block, c.remat, heads=c.heads, hidden=hidden,
                             causal=False)(x)
      memory = L.layer_norm("enc_ln_f")(x)
      y = embed(tgt_in) + dec_pos
      for i in range(c.layers):
        with hk.name_scope(f"decoder_{i}"):
          y = L.checkpointed(L.pre_ln_block, c.remat, heads=c.heads, hidden=hidden,
                             causal=True)(y, memory)
      y = L.layer_norm("dec_ln_f")(y)
      return y @ embed.embeddings.T
  return hk.without_apply_rng(hk.transform(forward))


def make(config: T5Config):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = L.adam(config.lr)

  def loss_fn(params, batch):
    logits = net.apply(params, batch["src"], batch["tgt_in"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt_out"]).mean()

  def init(key):
    ks, kt, kp = jax.random.split(key, 3)
    tgt = L.tokens(kt, config.batch, config.tgt_seq + 1, config.vocab)
    batch = {"src": L.tokens(ks, config.batch, config.src_seq, config.vocab),
             "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
    params = net.init(kp, batch["src"], batch["tgt_in"])
    return params, opt.init(params), batch

  return L.train_step_for(loss_fn, opt), init

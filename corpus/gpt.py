"""A GPT-style decoder training step: causal attention, pre-LayerNorm, tied embeddings,
integer-label cross-entropy, global-norm clipping and Adam."""

from __future__ import annotations

import dataclasses

import haiku as hk

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  vocab: int = 256
  seq: int = 16
  batch: int = 8
  remat: bool = False     # recompute each block's activations in the backward pass
  scan: bool = False      # layers as `hk.layer_stack` (lax.scan over stacked weights)
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": GPTConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": GPTConfig(layers=2, d_model=1024, heads=16, vocab=32768, seq=512, batch=32),
    "125m": GPTConfig(layers=12, d_model=768, heads=12, vocab=50304, seq=1024, batch=64,
                      remat=True),
    "350m": GPTConfig(layers=24, d_model=1024, heads=16, vocab=50304, seq=1024, batch=64,
                      remat=True),
    "1.3b": GPTConfig(layers=24, d_model=2048, heads=32, vocab=50304, seq=2048, batch=64,
                      remat=True),
    "6.7b": GPTConfig(layers=32, d_model=4096, heads=32, vocab=50304, seq=2048, batch=64,
                      remat=True),
}


def _forward(config: GPTConfig):
  def forward(tokens):
    with hk.name_scope("gpt"):
      embed = hk.Embed(config.vocab, config.d_model, name="embed", w_init=L.truncated())
      pos = hk.get_parameter("pos_embed", [config.seq, config.d_model], init=L.truncated())
      x = embed(tokens) + pos[: tokens.shape[1]]
      block = lambda x: L.checkpointed(L.pre_ln_block, config.remat, heads=config.heads,
                                       hidden=config.ffn_mult * config.d_model, causal=True)(x)
      if config.scan:
        with hk.name_scope("layers"):
          x = hk.layer_stack(config.layers)(block)(x)
      else:
        for i in range(config.layers):
          with hk.name_scope(f"layer_{i}"):
            x = block(x)
      x = L.layer_norm("ln_f")(x)
      return x @ embed.embeddings.T
  return hk.without_apply_rng(hk.transform(forward))


def make(config):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  return L.next_token_step(_forward(config), config)

"""A state-space language model step: each block runs a diagonal linear recurrence
(h_t = a * h_{t-1} + B x_t, y_t = C h_t + D x_t, as in S4D/LRU, real-valued) over time with
`lax.scan`, followed by a gated MLP; pre-LayerNorm residual blocks, cross-entropy and Adam.

The partitioner keeps the scan a loop (its body partitioned once, see `partitioner.tracing`), so
the program's size does not grow with the sequence; a short one is unrolled."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class SSMConfig:
  layers: int = 2
  d_model: int = 64
  state: int = 64          # recurrent state size per block
  ffn_mult: int = 2
  vocab: int = 256
  seq: int = 16
  batch: int = 8
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": SSMConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": SSMConfig(layers=2, d_model=1024, state=256, vocab=32768, seq=128, batch=32),
    "base": SSMConfig(layers=8, d_model=1024, state=1024, vocab=50304, seq=128, batch=64),
    "large": SSMConfig(layers=16, d_model=2048, state=2048, vocab=50304, seq=128, batch=64),
}


class LinearRecurrence(hk.Module):
  def __init__(self, state: int, name: str | None = None):
    super().__init__(name=name)
    self.state = state

  def __call__(self, x):
    b, s, d = x.shape
    u = hk.Linear(self.state, name="in_proj")(x)                    # B x_t
    decay = jax.nn.sigmoid(hk.get_parameter(
        "decay_logit", [self.state], init=hk.initializers.RandomUniform(1.0, 4.0)))

    def step(h, u_t):
      h = decay * h + u_t
      return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((b, self.state), x.dtype), u.swapaxes(0, 1))
    skip = hk.get_parameter("skip", [d], init=jnp.ones)            # D
    return hk.Linear(d, name="out_proj")(hs.swapaxes(0, 1)) + skip * x


def _forward(c: SSMConfig):
  def forward(tokens):
    with hk.name_scope("ssm"):
      embed = hk.Embed(c.vocab, c.d_model, name="embed", w_init=L.truncated())
      x = embed(tokens)
      for i in range(c.layers):
        with hk.name_scope(f"layer_{i}"):
          x = x + LinearRecurrence(c.state, name="recurrence")(L.layer_norm("ln1")(x))
          h = L.layer_norm("ln2")(x)
          gate = jax.nn.gelu(hk.Linear(c.ffn_mult * c.d_model, name="w_gate")(h))
          x = x + hk.Linear(c.d_model, name="w_out")(
              gate * hk.Linear(c.ffn_mult * c.d_model, name="w_in")(h))
      x = L.layer_norm("ln_f")(x)
      return x @ embed.embeddings.T
  return hk.without_apply_rng(hk.transform(forward))


def make(config):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  return L.next_token_step(_forward(config), config)

"""Building blocks shared by the corpus families: attention, transformer blocks, the training
step around a loss, and token batches."""

from __future__ import annotations

import functools
import math
from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import optax


def truncated(stddev: float = 0.02):
  return hk.initializers.TruncatedNormal(stddev)


def layer_norm(name: str):
  return hk.LayerNorm(-1, create_scale=True, create_offset=True, name=name)


class Attention(hk.Module):
  """Multi-head attention from `x` to `memory` (self-attention when `memory` is None)."""

  def __init__(self, heads: int, causal: bool = False, name: str | None = None):
    super().__init__(name=name)
    self.heads, self.causal = heads, causal

  def __call__(self, x, memory=None):
    memory = x if memory is None else memory
    b, s, d = x.shape
    t, h = memory.shape[1], self.heads
    q = hk.Linear(d, name="query")(x).reshape(b, s, h, d // h)
    k = hk.Linear(d, name="key")(memory).reshape(b, t, h, d // h)
    v = hk.Linear(d, name="value")(memory).reshape(b, t, h, d // h)
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d // h)
    if self.causal:
      logits = jnp.where(jnp.tril(jnp.ones((s, t), bool)), logits, -1e9)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhst,bthd->bshd", weights, v).reshape(b, s, d)
    return hk.Linear(d, name="out")(out)


def mlp(x, hidden: int, activation=jax.nn.gelu):
  """The transformer feed-forward block (`w_in`, `w_out`)."""
  h = activation(hk.Linear(hidden, name="w_in")(x))
  return hk.Linear(x.shape[-1], name="w_out")(h)


def pre_ln_block(x, memory=None, *, heads: int, hidden: int, causal: bool):
  """A pre-LayerNorm transformer block: self-attention, optional cross-attention, MLP."""
  x = x + Attention(heads, causal, name="attn")(layer_norm("ln1")(x))
  if memory is not None:
    x = x + Attention(heads, name="cross")(layer_norm("ln_cross")(x), memory)
  return x + mlp(layer_norm("ln2")(x), hidden)


def checkpointed(fn, remat: bool, **static):
  """`fn` with its non-array arguments bound, under `hk.remat` when `remat`: its activations
  are recomputed in the backward pass instead of kept, as large models are trained."""
  fn = functools.partial(fn, **static)
  return hk.remat(fn) if remat else fn


def train_step_for(loss_fn: Callable, optimizer: optax.GradientTransformation):
  """`train_step(params, opt_state, batch) -> (params, opt_state, loss)` around `loss_fn`."""

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def adam(lr: float, clip: float | None = 1.0):
  """Adam, with global-norm clipping as large models are trained."""
  if clip is None:
    return optax.adam(lr)
  return optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr))


def tokens(key, batch: int, seq: int, vocab: int):
  return jax.random.randint(key, (batch, seq), 0, vocab)


def next_token_step(net: hk.Transformed, config, aux_weight: float | None = None):
  """(train_step, init) of a language model: `net.apply(params, tokens)` gives logits (or
  `(logits, aux_loss)` when `aux_weight` is set); cross-entropy on the next token, Adam with
  clipping. `config` has batch, seq, vocab and lr."""
  opt = adam(config.lr)

  def loss_fn(params, batch):
    out = net.apply(params, batch["inputs"])
    logits, aux = out if aux_weight is not None else (out, 0.0)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return xent + (aux_weight or 0.0) * aux

  def init(key):
    kt, kp = jax.random.split(key)
    toks = tokens(kt, config.batch, config.seq + 1, config.vocab)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    params = net.init(kp, batch["inputs"])
    return params, opt.init(params), batch

  return train_step_for(loss_fn, opt), init

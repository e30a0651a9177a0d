"""The real-models tier: HuggingFace Flax models built from configs (random weights, nothing
downloaded) as training steps with an optax optimizer, written the way their users write them.

These programs are not in the corpus' house style: Flax parameter trees (`kernel`, `bias`,
`Dense_0`), GPT-2's fused q/k/v projection (`c_attn`), T5's relative position buckets, ViT's
patch convolution. Each family's `style` knob spells the same step three ways:
`named` (`train_step(params, opt_state, batch)`), `short` (`step(p, o, t)`) and `train_state`
(`train_step(state, batch)` with a Flax `TrainState` whose step count is a Python int and whose
`apply_fn`/`tx` are static fields). `dtype=bfloat16` keeps parameters and activations in bf16;
with `param_dtype=float32` too, the parameters and optimizer state stay f32 (master weights)
and the models compute in bf16.

Presets: `small` (tiny, for tests), `mini` (two layers at published widths) and the published
sizes: hf_gpt2 `124m`/`355m`, hf_bert `base`/`large`, hf_t5 `60m` (t5-small)/`220m` (t5-base),
hf_vit `base`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from partitioner.errors import WorkloadError

STYLES = ("named", "short", "train_state")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class HFConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 4
  ffn: int = 256
  vocab: int = 512
  seq: int = 32
  batch: int = 8
  image: int = 32          # ViT: image side
  patch: int = 8           # ViT: patch side
  classes: int = 10        # ViT: labels
  style: str = "named"
  dtype: str = "float32"       # activations (the models' computation dtype)
  param_dtype: str = ""        # parameters and optimizer state ("": dtype; float32: master)
  lr: float = 1e-3
  seed: int = 0


def _presets(**published) -> dict:
  return {"small": HFConfig(), **published}


GPT2_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, vocab=50257, seq=512, batch=16),
    **{"124m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=50257, seq=1024,
                        batch=32),
       "355m": HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=50257, seq=1024,
                        batch=32)})
BERT_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, vocab=30522, seq=512, batch=16),
    base=HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=30522, seq=512, batch=32),
    large=HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=30522, seq=512, batch=32))
T5_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=512, heads=8, ffn=2048, vocab=32128, seq=512, batch=16),
    **{"60m": HFConfig(layers=6, d_model=512, heads=8, ffn=2048, vocab=32128, seq=512, batch=32),
       "220m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=32128, seq=512,
                        batch=32)})
VIT_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, image=224, patch=16, classes=1000,
                  batch=32),
    base=HFConfig(layers=12, d_model=768, heads=12, ffn=3072, image=224, patch=16, classes=1000,
                  batch=64))


def _check(config: HFConfig) -> None:
  if config.style not in STYLES:
    raise WorkloadError(f"style must be one of {', '.join(STYLES)}, got {config.style!r}")
  for knob, allowed in (("dtype", DTYPES), ("param_dtype", ("",) + DTYPES)):
    if getattr(config, knob) not in allowed:
      raise WorkloadError(f"{knob} must be float32 or bfloat16, got {getattr(config, knob)!r}")
  if config.d_model % config.heads:
    raise WorkloadError(f"d_model {config.d_model} does not divide into {config.heads} heads")


def _cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _loss(model, inputs: str, labels: str, **keyword_inputs: str):
  """Cross-entropy of the model's logits on `batch[inputs]` (and keyword arguments taken from
  the batch) against `batch[labels]`."""
  def loss(params, batch):
    kwargs = {k: batch[v] for k, v in keyword_inputs.items()}
    return _cross_entropy(model(batch[inputs], params=params, **kwargs).logits, batch[labels])
  return loss


def _tokens(key, shape, vocab):
  return jax.random.randint(key, shape, 0, vocab, jnp.int32)


# Each model: config -> (the transformers model, input_shape for init_weights, loss(params,
# batch), batch(key)).
def _gpt2(c: HFConfig, dtype):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  cfg = GPT2Config(vocab_size=c.vocab, n_positions=c.seq, n_embd=c.d_model, n_layer=c.layers,
                   n_head=c.heads, n_inner=c.ffn, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0)
  model = FlaxGPT2LMHeadModel(cfg, dtype=dtype, _do_init=False)

  def loss(params, batch):
    logits = model(batch["tokens"], params=params).logits
    return _cross_entropy(logits[:, :-1], batch["tokens"][:, 1:])

  batch = lambda key: {"tokens": _tokens(key, (c.batch, c.seq), c.vocab)}
  return model, (1, c.seq), loss, batch


def _bert(c: HFConfig, dtype):
  from transformers import BertConfig, FlaxBertForMaskedLM
  cfg = BertConfig(vocab_size=c.vocab, hidden_size=c.d_model, num_hidden_layers=c.layers,
                   num_attention_heads=c.heads, intermediate_size=c.ffn,
                   max_position_embeddings=c.seq, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)
  model = FlaxBertForMaskedLM(cfg, dtype=dtype, _do_init=False)

  def batch(key):
    k1, k2 = jax.random.split(key)
    return {"tokens": _tokens(k1, (c.batch, c.seq), c.vocab),
            "labels": _tokens(k2, (c.batch, c.seq), c.vocab)}
  return model, (1, c.seq), _loss(model, "tokens", "labels"), batch


def _t5(c: HFConfig, dtype):
  from transformers import FlaxT5ForConditionalGeneration, T5Config
  cfg = T5Config(vocab_size=c.vocab, d_model=c.d_model, d_kv=c.d_model // c.heads, d_ff=c.ffn,
                 num_layers=c.layers, num_decoder_layers=c.layers, num_heads=c.heads,
                 dropout_rate=0.0)
  model = FlaxT5ForConditionalGeneration(cfg, dtype=dtype, _do_init=False)
  loss = _loss(model, "inputs", "targets", decoder_input_ids="decoder_inputs")

  def batch(key):
    k1, k2, k3 = jax.random.split(key, 3)
    half = max(c.seq // 2, 1)
    return {"inputs": _tokens(k1, (c.batch, c.seq), c.vocab),
            "decoder_inputs": _tokens(k2, (c.batch, half), c.vocab),
            "targets": _tokens(k3, (c.batch, half), c.vocab)}
  return model, (1, c.seq), loss, batch


def _vit(c: HFConfig, dtype):
  from transformers import FlaxViTForImageClassification, ViTConfig
  if c.image % c.patch:
    raise WorkloadError(f"image {c.image} does not divide into patches of {c.patch}")
  cfg = ViTConfig(image_size=c.image, patch_size=c.patch, hidden_size=c.d_model,
                  num_hidden_layers=c.layers, num_attention_heads=c.heads,
                  intermediate_size=c.ffn, num_labels=c.classes, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
  model = FlaxViTForImageClassification(cfg, dtype=dtype, _do_init=False)

  def batch(key):
    k1, k2 = jax.random.split(key)
    # The model's __call__ takes NCHW pixels (its init_weights NHWC).
    return {"images": jax.random.normal(k1, (c.batch, 3, c.image, c.image), dtype),
            "labels": jax.random.randint(k2, (c.batch,), 0, c.classes, jnp.int32)}
  return model, (1, c.image, c.image, 3), _loss(model, "images", "labels"), batch


def _make(build: Callable, config: HFConfig):
  """(train_step, init) for one model in the config's style; init(key) -> the arguments."""
  _check(config)
  dtype = jnp.dtype(config.dtype)
  param_dtype = jnp.dtype(config.param_dtype or config.dtype)
  model, input_shape, loss, make_batch = build(config, dtype)
  tx = optax.adamw(config.lr, weight_decay=0.01)

  def init_params(key):
    params = model.init_weights(key, input_shape)
    return jax.tree_util.tree_map(lambda x: x.astype(param_dtype), params)

  if config.style == "train_state":
    from flax.training import train_state

    def train_step(state, batch):
      value, grads = jax.value_and_grad(loss)(state.params, batch)
      return state.apply_gradients(grads=grads), value

    def init(key):
      k1, k2 = jax.random.split(key)
      state = train_state.TrainState.create(apply_fn=model.__call__, params=init_params(k1),
                                            tx=tx)
      return state, make_batch(k2)
    return train_step, init

  def step(p, o, t):
    value, grads = jax.value_and_grad(loss)(p, t)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, value

  if config.style == "named":
    def train_step(params, opt_state, batch):
      return step(params, opt_state, batch)
  else:
    train_step = step

  def init(key):
    k1, k2 = jax.random.split(key)
    params = init_params(k1)
    return params, tx.init(params), make_batch(k2)
  return train_step, init


class _Family:
  """A module-like record for the registry: `make`, `PRESETS`."""

  def __init__(self, name, build, presets):
    self.__name__ = f"corpus.{name}"
    self.make = functools.partial(_make, build)
    self.PRESETS = presets


hf_gpt2 = _Family("hf_gpt2", _gpt2, GPT2_PRESETS)
hf_bert = _Family("hf_bert", _bert, BERT_PRESETS)
hf_t5 = _Family("hf_t5", _t5, T5_PRESETS)
hf_vit = _Family("hf_vit", _vit, VIT_PRESETS)

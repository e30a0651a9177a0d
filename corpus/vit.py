"""A Vision Transformer classification step: non-overlapping patches embedded by a linear map
(written as reshapes and a matmul), a class token, learned positions, pre-LN blocks, a linear
head on the class token, softmax cross-entropy and AdamW."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from corpus import layers as L
from partitioner.errors import WorkloadError


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 8
  ffn_mult: int = 4
  image: int = 16
  patch: int = 4
  channels: int = 3
  classes: int = 10
  batch: int = 8
  remat: bool = False
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": ViTConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": ViTConfig(layers=2, d_model=1024, heads=16, image=224, patch=16, classes=1000, batch=128),
    "base": ViTConfig(layers=12, d_model=768, heads=12, image=224, patch=16, classes=1000,
                      batch=1024, remat=True),
    "large": ViTConfig(layers=24, d_model=1024, heads=16, image=224, patch=16, classes=1000,
                       batch=1024, remat=True),
    "huge": ViTConfig(layers=32, d_model=1280, heads=16, image=224, patch=14, classes=1000,
                      batch=1024, remat=True),
}


def embed_patches(c, images):
  """Patch embedding (reshapes and a matmul), the class token and learned positions."""
  b = images.shape[0]
  g, p = c.image // c.patch, c.patch
  patches = images.reshape(b, g, p, g, p, c.channels).transpose(0, 1, 3, 2, 4, 5)
  x = hk.Linear(c.d_model, name="patch_embed")(patches.reshape(b, g * g, p * p * c.channels))
  cls = hk.get_parameter("cls", [1, 1, c.d_model], init=L.truncated())
  x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, c.d_model)), x], axis=1)
  return x + hk.get_parameter("pos_embed", [g * g + 1, c.d_model], init=L.truncated())


def classify(c, x):
  """The final norm and the linear head on the class token."""
  return hk.Linear(c.classes, name="head")(L.layer_norm("ln_f")(x[:, 0]))


def _forward(c: ViTConfig):
  def forward(images):
    with hk.name_scope("vit"):
      x = embed_patches(c, images)
      for i in range(c.layers):
        with hk.name_scope(f"layer_{i}"):
          x = L.checkpointed(L.pre_ln_block, c.remat, heads=c.heads,
                             hidden=c.ffn_mult * c.d_model, causal=False)(x)
      return classify(c, x)
  return hk.without_apply_rng(hk.transform(forward))


def make(config: ViTConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  return classifier_step(_forward(config), config)


def classifier_step(net: hk.Transformed, config, aux_weight: float | None = None):
  """(train_step, init) of an image classifier: `net.apply(params, images)` gives logits (or
  `(logits, aux_loss)` when `aux_weight` is set); softmax cross-entropy, AdamW with clipping.
  `config` has image, patch, channels, classes, batch and lr."""
  if config.image % config.patch:
    raise WorkloadError(f"image {config.image} is not a multiple of patch {config.patch}")
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(config.lr, weight_decay=0.05))

  def loss_fn(params, batch):
    out = net.apply(params, batch["images"])
    logits, aux = out if aux_weight is not None else (out, 0.0)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    return xent + (aux_weight or 0.0) * aux

  def init(key):
    ki, kl, kp = jax.random.split(key, 3)
    shape = (config.batch, config.image, config.image, config.channels)
    batch = {"images": jax.random.normal(ki, shape),
             "labels": jax.random.randint(kl, (config.batch,), 0, config.classes)}
    params = net.init(kp, batch["images"])
    return params, opt.init(params), batch

  return L.train_step_for(loss_fn, opt), init

"""A ResNet image-classification step (Haiku's `hk.nets.ResNet`): convolutions, batch norm with
batch statistics in training and running averages kept in `model_state`, max pooling, softmax
cross-entropy with weight decay, and SGD with Nesterov momentum.

The step is `train_step(params, model_state, opt_state, batch)`; `model_state` (the batch-norm
averages) is treated like the parameters by the partitioner."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from partitioner.errors import WorkloadError

# depth -> (blocks per group, bottleneck blocks)
DEPTHS = {10: ((1, 1, 1, 1), False), 18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False),
          50: ((3, 4, 6, 3), True), 101: ((3, 4, 23, 3), True), 152: ((3, 8, 36, 3), True)}


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  depth: int = 10
  width: int = 8           # channels of the stem and the first group
  image: int = 32
  channels: int = 3
  classes: int = 10
  batch: int = 8
  lr: float = 0.1
  weight_decay: float = 1e-4
  seed: int = 0


PRESETS = {
    "small": ResNetConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": ResNetConfig(depth=10, width=64, image=64, classes=1000, batch=256),
    "50": ResNetConfig(depth=50, width=64, image=224, classes=1000, batch=1024),
    "101": ResNetConfig(depth=101, width=64, image=224, classes=1000, batch=1024),
    "152": ResNetConfig(depth=152, width=64, image=224, classes=1000, batch=1024),
}


def _forward(c: ResNetConfig):
  if c.depth not in DEPTHS:
    raise WorkloadError(f"resnet: depth must be one of {', '.join(map(str, DEPTHS))}, "
                        f"got {c.depth}")
  blocks, bottleneck = DEPTHS[c.depth]
  out_mult = 4 if bottleneck else 1
  channels = tuple(c.width * out_mult * 2 ** i for i in range(4))

  def forward(images, is_training):
    net = hk.nets.ResNet(blocks, c.classes, bottleneck=bottleneck, channels_per_group=channels,
                         initial_conv_config={"output_channels": c.width}, name="resnet")
    return net(images, is_training=is_training)
  return hk.without_apply_rng(hk.transform_with_state(forward))


def make(config: ResNetConfig):
  """(train_step, init) for the config; init(key) -> (params, model_state, opt_state, batch)."""
  net = _forward(config)
  opt = optax.sgd(config.lr, momentum=0.9, nesterov=True)

  def loss_fn(params, model_state, batch):
    logits, model_state = net.apply(params, model_state, batch["images"], True)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    decay = sum(jnp.sum(w ** 2) for w in jax.tree_util.tree_leaves(params))
    return xent + 0.5 * config.weight_decay * decay, model_state

  def train_step(params, model_state, opt_state, batch):
    (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, model_state, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), model_state, opt_state, loss

  def init(key):
    ki, kl, kp = jax.random.split(key, 3)
    shape = (config.batch, config.image, config.image, config.channels)
    batch = {"images": jax.random.normal(ki, shape),
             "labels": jax.random.randint(kl, (config.batch,), 0, config.classes)}
    params, model_state = net.init(kp, batch["images"], True)
    return params, model_state, opt.init(params), batch

  return train_step, init

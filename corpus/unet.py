"""A diffusion UNet training step (DDPM-style noise prediction): residual conv blocks with
group norm and a timestep embedding, strided-conv down-sampling, nearest-neighbour
up-sampling, skip connections concatenated on the way up, a cosine noise schedule, MSE on the
predicted noise and Adam."""

from __future__ import annotations

import dataclasses
import math

import haiku as hk
import jax
import jax.numpy as jnp

from corpus import layers as L
from partitioner.errors import WorkloadError


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  base: int = 16           # channels at the top level
  levels: int = 2          # resolutions; channel multiplier doubles per level (max 4)
  blocks: int = 1          # residual blocks per level
  groups: int = 4
  image: int = 16
  channels: int = 3
  batch: int = 8
  lr: float = 2e-4
  seed: int = 0


PRESETS = {
    "small": UNetConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": UNetConfig(base=64, levels=2, blocks=1, groups=16, image=64, batch=32),
    "base": UNetConfig(base=128, levels=4, blocks=2, groups=32, image=64, batch=128),
    "large": UNetConfig(base=256, levels=4, blocks=2, groups=32, image=128, batch=64),
}


def _conv(ch, name, stride=1, k=3):
  return hk.Conv2D(ch, k, stride=stride, name=name)


def _res_block(x, temb, ch, groups, name):
  with hk.name_scope(name):
    h = _conv(ch, "conv1")(jax.nn.swish(hk.GroupNorm(groups, name="norm1")(x)))
    h = h + hk.Linear(ch, name="temb")(temb)[:, None, None, :]
    h = _conv(ch, "conv2")(jax.nn.swish(hk.GroupNorm(groups, name="norm2")(h)))
    skip = x if x.shape[-1] == ch else _conv(ch, "skip", k=1)(x)
    return skip + h


def _timestep_embedding(t, dim):
  half = dim // 2
  freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half) / half)
  angles = t[:, None] * 1000.0 * freqs[None]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def _forward(c: UNetConfig):
  mults = [min(2 ** i, 4) for i in range(c.levels)]
  if c.image % 2 ** (c.levels - 1):
    raise WorkloadError(f"unet: image {c.image} does not halve {c.levels - 1} times")

  def forward(x, t):
    with hk.name_scope("unet"):
      temb = _timestep_embedding(t, c.base)
      temb = hk.Linear(4 * c.base, name="temb_out")(
          jax.nn.swish(hk.Linear(4 * c.base, name="temb_in")(temb)))
      h = _conv(c.base, "stem")(x)
      skips = [h]
      for level, m in enumerate(mults):
        for i in range(c.blocks):
          h = _res_block(h, temb, c.base * m, c.groups, f"down_{level}_{i}")
          skips.append(h)
        if level < c.levels - 1:
          h = _conv(h.shape[-1], f"downsample_{level}", stride=2)(h)
          skips.append(h)
      h = _res_block(h, temb, h.shape[-1], c.groups, "middle")
      for level in reversed(range(c.levels)):
        for i in range(c.blocks + 1):
          h = jnp.concatenate([h, skips.pop()], axis=-1)
          h = _res_block(h, temb, c.base * mults[level], c.groups, f"up_{level}_{i}")
        if level > 0:
          h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
          h = _conv(h.shape[-1], f"upsample_{level}")(h)
      h = jax.nn.swish(hk.GroupNorm(c.groups, name="norm_out")(h))
      return _conv(c.channels, "out")(h)
  return hk.without_apply_rng(hk.transform(forward))


def make(config: UNetConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = L.adam(config.lr)

  def loss_fn(params, batch):
    alpha = jnp.cos(0.5 * math.pi * batch["t"])[:, None, None, None] ** 2
    noisy = jnp.sqrt(alpha) * batch["images"] + jnp.sqrt(1 - alpha) * batch["noise"]
    return jnp.mean((net.apply(params, noisy, batch["t"]) - batch["noise"]) ** 2)

  def init(key):
    ki, kn, kt, kp = jax.random.split(key, 4)
    shape = (config.batch, config.image, config.image, config.channels)
    batch = {"images": jax.random.normal(ki, shape), "noise": jax.random.normal(kn, shape),
             "t": jax.random.uniform(kt, (config.batch,))}
    params = net.init(kp, batch["images"], batch["t"])
    return params, opt.init(params), batch

  return L.train_step_for(loss_fn, opt), init

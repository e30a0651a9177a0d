"""A multi-layer perceptron regression step: the smallest realistic training workload."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  layers: int = 3
  width: int = 256
  in_dim: int = 64
  out_dim: int = 16
  batch: int = 32
  lr: float = 1e-3
  seed: int = 0


PRESETS = {
    "small": MLPConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": MLPConfig(layers=3, width=4096, in_dim=1024, out_dim=1024, batch=512),
    "large": MLPConfig(layers=8, width=8192, in_dim=1024, out_dim=1024, batch=1024),
}


def _forward(config: MLPConfig):
  def forward(x):
    with hk.name_scope("mlp"):
      for i in range(config.layers - 1):
        x = jax.nn.relu(hk.Linear(config.width, name=f"layer_{i}")(x))
      return hk.Linear(config.out_dim, name=f"layer_{config.layers - 1}")(x)
  return hk.without_apply_rng(hk.transform(forward))


def make(config: MLPConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = optax.adam(config.lr)

  def loss_fn(params, batch):
    pred = net.apply(params, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def init(key):
    kx, ky, kp = jax.random.split(key, 3)
    batch = {"x": jax.random.normal(kx, (config.batch, config.in_dim)),
             "y": jax.random.normal(ky, (config.batch, config.out_dim))}
    params = net.init(kp, batch["x"])
    return params, opt.init(params), batch

  return train_step, init

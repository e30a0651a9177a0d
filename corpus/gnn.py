"""A graph-network simulator step (encode-process-decode, as in the learned mesh and particle
simulators): node and edge encoders, message-passing rounds that gather sender and receiver
features along edges and scatter-add the messages to receivers, a node decoder, MSE on
per-node targets, and Adam. Graphs are batched with a leading graph dimension and a fixed
number of nodes and edges each (padding, as graph batches are usually built)."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp

from corpus import layers as L


@dataclasses.dataclass(frozen=True)
class GNNConfig:
  steps: int = 2           # message-passing rounds
  latent: int = 32
  mlp_layers: int = 2
  nodes: int = 32          # per graph
  edges: int = 64          # per graph
  node_features: int = 8
  edge_features: int = 4
  outputs: int = 3
  batch: int = 8           # graphs per step
  lr: float = 1e-4
  seed: int = 0


PRESETS = {
    "small": GNNConfig(),
    # two layers at realistic widths: a small graph where partitioning matters
    "mini": GNNConfig(steps=2, latent=256, nodes=2048, edges=12288, batch=32),
    "base": GNNConfig(steps=15, latent=128, nodes=2048, edges=12288, batch=64),
    "large": GNNConfig(steps=15, latent=512, nodes=4096, edges=24576, batch=64),
}


def _mlp(c: GNNConfig, out: int, name: str, norm: bool = True):
  sizes = [c.latent] * (c.mlp_layers - 1) + [out]
  layers = [hk.nets.MLP(sizes, activate_final=False, name=name)]
  if norm:
    layers.append(L.layer_norm(f"{name}_ln"))
  return hk.Sequential(layers)


def _forward(c: GNNConfig):
  def forward(nodes, edges, senders, receivers):
    b, n = nodes.shape[:2]
    graph = jnp.arange(b)[:, None]
    with hk.name_scope("gnn"):
      x = _mlp(c, c.latent, "node_encoder")(nodes)
      e = _mlp(c, c.latent, "edge_encoder")(edges)
      for i in range(c.steps):
        sent = jnp.take_along_axis(x, senders[..., None], axis=1)
        received = jnp.take_along_axis(x, receivers[..., None], axis=1)
        e = e + _mlp(c, c.latent, f"edge_{i}")(jnp.concatenate([e, sent, received], -1))
        inbox = jnp.zeros((b, n, c.latent), e.dtype).at[graph, receivers].add(e)
        x = x + _mlp(c, c.latent, f"node_{i}")(jnp.concatenate([x, inbox], -1))
      return _mlp(c, c.outputs, "decoder", norm=False)(x)
  return hk.without_apply_rng(hk.transform(forward))


def make(config: GNNConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  net = _forward(config)
  opt = L.adam(config.lr)

  def loss_fn(params, batch):
    pred = net.apply(params, batch["nodes"], batch["edges"], batch["senders"],
                     batch["receivers"])
    return jnp.mean((pred - batch["targets"]) ** 2)

  def init(key):
    kn, ke, ks, kr, kt, kp = jax.random.split(key, 6)
    c = config
    batch = {"nodes": jax.random.normal(kn, (c.batch, c.nodes, c.node_features)),
             "edges": jax.random.normal(ke, (c.batch, c.edges, c.edge_features)),
             "senders": jax.random.randint(ks, (c.batch, c.edges), 0, c.nodes),
             "receivers": jax.random.randint(kr, (c.batch, c.edges), 0, c.nodes),
             "targets": jax.random.normal(kt, (c.batch, c.nodes, c.outputs))}
    params = net.init(kp, batch["nodes"], batch["edges"], batch["senders"], batch["receivers"])
    return params, opt.init(params), batch

  return L.train_step_for(loss_fn, opt), init

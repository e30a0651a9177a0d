"""A graph network over the observation, a pointer head over the candidate actions and a value
head (Haiku).

Nodes are the program's values; messages flow along operand->result edges and back, with
separate weights per direction, for `rounds` rounds. Each candidate action is scored from its
own features, the mean embedding of the values it tiles (a decision point's members, a manual
tactic's footprint) and a pooled summary of the graph, so the
same parameters serve any action space: a task with other decision points has other rows,
not another head. Illegal actions get `MASKED` logits. Everything is written for one
observation and vmapped over batches; shapes come from the padded size buckets, so one
compilation serves every task of a bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import chex
import haiku as hk
import jax
import jax.numpy as jnp

from environments.observations import (ACTION_FEATURES, GLOBAL_FEATURES, NODE_FEATURES, NUM_KINDS,
                                       SHARDING_FEATURES, TOUCHED)

MASKED = -1e9


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
  hidden: int = 32
  rounds: int = 3


class PolicyOutput(NamedTuple):
  logits: jax.Array      # [actions], MASKED where illegal
  value: jax.Array       # []


class Networks(NamedTuple):
  """`init(rng, observation)` and `apply(params, observation)` on batched observations (any
  number of leading dims); `config` says how they were built (saved with checkpoints)."""
  init: Callable
  apply: Callable
  config: NetworkConfig


def _mlp(width: int, out: int, name: str) -> hk.Module:
  return hk.nets.MLP([width, out], activation=jax.nn.relu, name=name)


def _check(obs: dict) -> None:
  """The observation is one padded graph of this encoding (`environments.observations`)."""
  n, e, a = obs["node_kind"].shape[0], obs["senders"].shape[0], obs["actions"].shape[0]
  chex.assert_shape([obs["node_kind"], obs["node_mask"]], (n,))
  chex.assert_shape(obs["nodes"], (n, NODE_FEATURES))
  chex.assert_shape(obs["node_sharding"], (n, SHARDING_FEATURES))
  chex.assert_shape([obs["senders"], obs["receivers"], obs["edge_direction"],
                     obs["edge_mask"]], (e,))
  chex.assert_shape(obs["actions"], (a, ACTION_FEATURES))
  chex.assert_shape([obs["action_nodes"], obs["action_nodes_mask"]], (a, TOUCHED))
  chex.assert_shape(obs["action_mask"], (a,))
  chex.assert_shape(obs["globals"], (GLOBAL_FEATURES,))


def _forward(obs: dict, config: NetworkConfig) -> PolicyOutput:
  _check(obs)
  h_dim = config.hidden
  node_mask = obs["node_mask"].astype(jnp.float32)[:, None]
  h = (hk.Embed(NUM_KINDS, h_dim, name="kind")(obs["node_kind"])
       + hk.Linear(h_dim, name="node_in")(jnp.concatenate([obs["nodes"], obs["node_sharding"]],
                                                           axis=-1)))
  h = jax.nn.relu(h) * node_mask
  n = h.shape[0]
  senders, receivers = obs["senders"], obs["receivers"]
  edge_mask = obs["edge_mask"].astype(jnp.float32)
  forward = (obs["edge_direction"] == 0).astype(jnp.float32) * edge_mask
  backward = (obs["edge_direction"] == 1).astype(jnp.float32) * edge_mask
  degree = lambda w: jnp.maximum(jax.ops.segment_sum(w, receivers, n), 1.0)[:, None]
  deg_f, deg_b = degree(forward), degree(backward)
  for r in range(config.rounds):
    # Transform on nodes, then gather: cheaper than transforming every edge.
    msg_f = hk.Linear(h_dim, name=f"msg_fwd_{r}")(h)[senders] * forward[:, None]
    msg_b = hk.Linear(h_dim, name=f"msg_bwd_{r}")(h)[senders] * backward[:, None]
    agg_f = jax.ops.segment_sum(msg_f, receivers, n) / deg_f
    agg_b = jax.ops.segment_sum(msg_b, receivers, n) / deg_b
    update = _mlp(h_dim, h_dim, f"update_{r}")(jnp.concatenate([h, agg_f, agg_b], axis=-1))
    h = hk.LayerNorm(-1, True, True, name=f"norm_{r}")(h + update) * node_mask
  pooled = h.sum(0) / jnp.maximum(node_mask.sum(), 1.0)
  context = _mlp(h_dim, h_dim, "context")(jnp.concatenate([pooled, obs["globals"]]))
  context = jax.nn.relu(context)
  a = obs["actions"].shape[0]
  touched_mask = obs["action_nodes_mask"].astype(jnp.float32)[..., None]
  touched = ((h[obs["action_nodes"]] * touched_mask).sum(1)
             / jnp.maximum(touched_mask.sum(1), 1.0))
  rows = jnp.concatenate([obs["actions"], touched, jnp.broadcast_to(context, (a, h_dim))],
                         axis=-1)
  logits = _mlp(h_dim, 1, "pointer")(rows)[:, 0]
  logits = jnp.where(obs["action_mask"], logits, MASKED)
  value = _mlp(h_dim, 1, "value")(context)[0]
  return PolicyOutput(logits, value)


def make_networks(config: NetworkConfig = NetworkConfig()) -> Networks:
  net = hk.without_apply_rng(hk.transform(lambda obs: _forward(obs, config)))

  def batched(fn):
    def call(params, obs):
      lead = obs["node_kind"].ndim - 1
      f = lambda o: fn(params, o)
      for _ in range(lead):
        f = jax.vmap(f)
      return f(obs)
    return call

  def init(rng, obs):
    one = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[obs["node_kind"].ndim - 1:])[0],
                                 obs)
    return net.init(rng, one)

  return Networks(init, batched(net.apply), config)


def masked_entropy(logits: jax.Array) -> jax.Array:
  """Entropy of the policy over legal actions only (masked actions carry no probability)."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(logits > MASKED / 2, p * logp, 0.0), axis=-1)

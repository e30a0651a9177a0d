"""A decoder written the MaxText way: every layer weight stacked with a leading layer
dimension, the layers run by `lax.scan` over a dict of those stacks, Adam from optax."""

import jax
import jax.numpy as jnp
import optax
from jax import lax


def workload(layers=4, d=64, heads=4, ffn=256, vocab=128, batch=8, seq=16):
  tx = optax.adam(1e-3)
  keys = jax.random.split(jax.random.PRNGKey(0), 10)
  normal = lambda k, shape: jax.random.normal(k, shape) * 0.05
  params = {"embed": normal(keys[0], (vocab, d)),
            "layers": {"wq": normal(keys[1], (layers, d, d)), "wk": normal(keys[2], (layers, d, d)),
                       "wv": normal(keys[3], (layers, d, d)), "wo": normal(keys[4], (layers, d, d)),
                       "w1": normal(keys[5], (layers, d, ffn)),
                       "w2": normal(keys[6], (layers, ffn, d)), "ln": jnp.ones((layers, d))}}

  def layer(x, w):
    h = x * w["ln"]
    split = lambda t: t.reshape(batch, seq, heads, d // heads)
    q, k, v = split(h @ w["wq"]), split(h @ w["wk"]), split(h @ w["wv"])
    probs = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / (d // heads) ** 0.5, axis=-1)
    x = x + jnp.einsum("bhst,bthd->bshd", probs, v).reshape(batch, seq, d) @ w["wo"]
    return x + jax.nn.gelu(x @ w["w1"]) @ w["w2"], None

  def loss(p, b):
    x, _ = lax.scan(layer, p["embed"][b["tokens"]], p["layers"])
    logp = jax.nn.log_softmax(x @ p["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], -1))

  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  data = {"tokens": jax.random.randint(keys[7], (batch, seq), 0, vocab),
          "targets": jax.random.randint(keys[8], (batch, seq), 0, vocab)}
  return train_step, (params, tx.init(params), data)

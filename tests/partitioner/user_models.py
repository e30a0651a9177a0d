"""Training steps written the way other code bases write them, for the front-end tests."""

import jax
import jax.numpy as jnp
import optax
from jax import lax


def scanned_decoder(layers=4, d=64, heads=4, ffn=256, vocab=128, batch=8, seq=16, dtype=None):
  """A decoder written the MaxText way: every layer weight stacked with a leading layer
  dimension, the layers run by `lax.scan` over a dict of those stacks, Adam from optax. With
  `dtype`, the layers compute in it on their weights cast once, before the stack (float32
  master weights)."""
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
    split = lambda t: t.reshape(*t.shape[:2], heads, d // heads)
    q, k, v = split(h @ w["wq"]), split(h @ w["wk"]), split(h @ w["wv"])
    probs = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k) / (d // heads) ** 0.5, axis=-1)
    x = x + jnp.einsum("bhst,bthd->bshd", probs, v).reshape(x.shape) @ w["wo"]
    return x + jax.nn.gelu(x @ w["w1"]) @ w["w2"], None

  def loss(p, b):
    if dtype is None:
      x, _ = lax.scan(layer, p["embed"][b["tokens"]], p["layers"])
    else:
      stack = jax.tree_util.tree_map(lambda w: w.astype(dtype), p["layers"])
      x, _ = lax.scan(layer, p["embed"][b["tokens"]].astype(dtype), stack)
      x = x.astype(jnp.float32)
    logp = jax.nn.log_softmax(x @ p["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], -1))

  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  data = {"tokens": jax.random.randint(keys[7], (batch, seq), 0, vocab),
          "targets": jax.random.randint(keys[8], (batch, seq), 0, vocab)}
  return train_step, (params, tx.init(params), data)


def grouped_query_attention(batch=8, seq=16, d=64, heads=4, kv_heads=2, ffn=128):
  """One attention block with fewer key/value heads than query heads (repeated to match)."""
  hd = d // heads
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  normal = lambda k, shape: jax.random.normal(k, shape) * 0.05
  params = {"wq": normal(keys[0], (d, d)), "wk": normal(keys[1], (d, kv_heads * hd)),
            "wv": normal(keys[2], (d, kv_heads * hd)), "wo": normal(keys[3], (d, d)),
            "w1": normal(keys[4], (d, ffn)), "w2": normal(keys[5], (ffn, d))}
  tx = optax.adam(1e-3)

  def loss(p, b):
    x = b["x"]
    q = (x @ p["wq"]).reshape(batch, seq, heads, hd)
    k = jnp.repeat((x @ p["wk"]).reshape(batch, seq, kv_heads, hd), heads // kv_heads, axis=2)
    v = jnp.repeat((x @ p["wv"]).reshape(batch, seq, kv_heads, hd), heads // kv_heads, axis=2)
    probs = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k), -1)
    y = x + jnp.einsum("bhst,bthd->bshd", probs, v).reshape(batch, seq, d) @ p["wo"]
    y = y + jax.nn.gelu(y @ p["w1"]) @ p["w2"]
    return jnp.mean((y - b["y"]) ** 2)

  def train_step(params, opt_state, batch_):
    value, grads = jax.value_and_grad(loss)(params, batch_)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  data = {"x": jax.random.normal(keys[6], (batch, seq, d)),
          "y": jax.random.normal(keys[7], (batch, seq, d))}
  return train_step, (params, tx.init(params), data)


def microbatched_mlp(accum=4, batch=16, d=32, hidden=64):
  """Gradient accumulation: micro-batches stacked on a leading dimension, their gradients
  summed by `lax.scan`, one Adam update."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(keys[0], (d, hidden)) * 0.1,
            "w2": jax.random.normal(keys[1], (hidden, d)) * 0.1}
  tx = optax.adam(1e-3)

  def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  def train_step(params, opt_state, micro):
    def accumulate(total, xy):
      value, grads = jax.value_and_grad(loss)(params, *xy)
      return jax.tree_util.tree_map(jnp.add, total, (value, grads)), None
    zero = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, params))
    (value, grads), _ = lax.scan(accumulate, zero, (micro["x"], micro["y"]))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value / accum

  data = {"x": jax.random.normal(keys[2], (accum, batch, d)),
          "y": jax.random.normal(keys[3], (accum, batch, d))}
  return train_step, (params, tx.init(params), data)


def flax_scanned_blocks(layers=6, d=64, ffn=256, batch=16, seq=8):
  """Residual MLP blocks stacked with Flax's `nn.scan` (parameters with a leading layer
  dimension), trained with a Flax `TrainState` and AdamW: `train_step(state, batch)`."""
  import flax.linen as nn
  from flax.training import train_state

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm()(x)
      h = nn.Dense(d)(nn.gelu(nn.Dense(ffn)(h)))
      return x + h, None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=layers)
      x, _ = stack(name="blocks")(nn.Dense(d)(x), None)
      return nn.Dense(1)(x)

  model = Model()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (batch, seq, d))
  y = jax.random.normal(keys[1], (batch, seq, 1))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(keys[2], x)["params"],
                                        # eps well above f32 rounding of the gradients:
                                        # Adam's first step is g / (|g| + eps), which turns a
                                        # rounding difference in a gradient near 0 into one
                                        # of the size of the learning rate.
                                        tx=optax.adamw(1e-3, eps=1e-6))

  def train_step(state, batch):
    def loss(params):
      return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value

  return train_step, (state, {"x": x, "y": y})


RENAMES = {"embed": "tok_embeddings", "layers": "blocks", "wq": "q_proj", "wk": "k_proj",
           "wv": "v_proj", "wo": "o_proj", "w1": "up_proj", "w2": "down_proj", "ln": "norm_scale",
           "tokens": "input_ids", "targets": "labels"}


def renamed_scanned_decoder(**knobs):
  """`scanned_decoder` with every parameter and batch entry under another name (keys that
  also sort in another order): the same program, as someone else would name it."""
  fn, args = scanned_decoder(**knobs)
  names = RENAMES
  back = {v: k for k, v in names.items()}

  def rename(tree, table):
    if isinstance(tree, dict):
      return {table.get(k, k): rename(v, table) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):   # optax's states
      return type(tree)(*(rename(v, table) for v in tree))
    if isinstance(tree, (tuple, list)):
      return type(tree)(rename(v, table) for v in tree)
    return tree

  def train_step(params, opt_state, data):
    return rename(fn(rename(params, back), rename(opt_state, back), rename(data, back)), names)
  return train_step, rename(args, names)


WIDE = dict(layers=4, d=1024, heads=16, ffn=4096, vocab=32000, batch=64, seq=512)


def wide_decoder():
  """`scanned_decoder` at widths where partitioning pays on 8 H100s."""
  return scanned_decoder(**WIDE)


def renamed_wide_decoder():
  return renamed_scanned_decoder(**WIDE)

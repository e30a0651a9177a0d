"""A user's model for the CLI tests: `tests/launch/user_model.py:workload`."""

import jax
import jax.numpy as jnp


def workload():
  def loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

  def step(params, batch):
    return jax.value_and_grad(loss)(params, batch)

  params = {"w1": jnp.ones((16, 32)) * 0.1, "w2": jnp.ones((32, 4)) * 0.1}
  batch = {"x": jax.random.normal(jax.random.PRNGKey(0), (8, 16)), "y": jnp.zeros((8, 4))}
  return step, (params, batch)


def not_a_workload():
  return 42


def raises():
  raise RuntimeError("no data here")


def step_raises():
  def step(params, batch):
    return params["w"] * batch["labels"]
  return step, ({"w": jnp.ones(3)}, {"x": jnp.ones(3)})

"""Golden values of the PPO and AlphaZero losses on inputs small enough to compute by hand (as
rlax tests its losses), jitted and not; and their shape checks at the entry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.networks import MASKED, NetworkConfig, Networks, PolicyOutput
from learners.alphazero.config import AlphaZeroConfig
from learners.alphazero.losses import alphazero_loss
from learners.ppo.config import PPOConfig
from learners.ppo.losses import ppo_loss

# A network whose outputs are given in the observation: the loss alone is under test.
GIVEN = Networks(init=lambda rng, obs: {},
                 apply=lambda params, obs: PolicyOutput(obs["logits"], obs["value"]),
                 config=NetworkConfig())


def _maybe_jit(fn, jit):
  return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_alphazero_loss_golden_values(jit):
  # Row 1: softmax(0, ln 2) = (1/3, 2/3) against visits (1/2, 1/2); value 1 for return 3.
  # Row 2: softmax(ln 3, 0) = (3/4, 1/4) against visits (1, 0); value -1 for a return of -6,
  # clipped to -4. The third action is masked and unvisited: it adds nothing (and no NaN).
  batch = {
      "observation": {"logits": jnp.array([[0.0, math.log(2), MASKED],
                                           [math.log(3), 0.0, MASKED]]),
                      "value": jnp.array([1.0, -1.0])},
      "visits": jnp.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]),
      "return": jnp.array([3.0, -6.0]),
  }
  loss_fn = _maybe_jit(alphazero_loss(GIVEN, AlphaZeroConfig(value_cost=0.5, return_clip=4.0)),
                       jit)
  loss, metrics = loss_fn({}, batch)
  policy = (0.5 * math.log(4.5) + math.log(4 / 3)) / 2
  value = (0.5 * 2.0 ** 2 + 0.5 * 3.0 ** 2) / 2
  np.testing.assert_allclose(metrics["policy_loss"], policy, rtol=1e-6)
  np.testing.assert_allclose(metrics["value_loss"], value, rtol=1e-6)
  np.testing.assert_allclose(loss, policy + 0.5 * value, rtol=1e-6)
  np.testing.assert_allclose(metrics["argmax_agreement"], 0.5)   # row 1's visits tie: first


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ppo_loss_golden_values(jit):
  # Two sequences of one action (T = 1), both actions equally likely under the current policy.
  # A: reward 1, truncated (discount 1): advantage 1 + 2.0 - 0.5 = 2.5, target 3; behaviour
  #    probability 1/4, so the ratio is 2 (clipped to 1.2).
  # B: reward -1, terminated (discount 0): advantage -1, target -1; ratio 1.
  # Normalised advantages are +1 and -1 (mean 0.75, std 1.75).
  batch = {
      "observation": {"logits": jnp.zeros((2, 2, 2)),
                      "value": jnp.array([[0.5, 2.0], [0.0, 0.5]])},
      "action": jnp.array([[0, 0], [1, 0]], jnp.int32),
      "reward": jnp.array([[1.0, 0.0], [-1.0, 0.0]]),
      "discount": jnp.array([[1.0, 0.0], [0.0, 0.0]]),
      "valid": jnp.array([[1.0, 0.0], [1.0, 0.0]]),
      "log_prob": jnp.array([[math.log(0.25), 0.0], [math.log(0.5), 0.0]]),
  }
  config = PPOConfig(clip_epsilon=0.2, gae_lambda=0.95, discount=1.0, entropy_cost=0.01,
                     value_cost=0.5, reward_clip=2.0)
  loss, metrics = _maybe_jit(ppo_loss(GIVEN, config), jit)({}, batch)
  pg = -(min(2 * 1.0, 1.2 * 1.0) + min(1 * -1.0, 1 * -1.0)) / 2
  value = 0.5 * ((0.5 - 3.0) ** 2 + (0.0 + 1.0) ** 2) / 2
  np.testing.assert_allclose(metrics["policy_loss"], pg, rtol=1e-5)
  np.testing.assert_allclose(metrics["value_loss"], value, rtol=1e-6)
  np.testing.assert_allclose(metrics["entropy"], math.log(2), rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_fraction"], 0.5)
  np.testing.assert_allclose(metrics["advantage_mean"], 0.75, rtol=1e-6)
  np.testing.assert_allclose(loss, pg + 0.5 * value - 0.01 * math.log(2), rtol=1e-5)


def test_losses_check_the_shapes_they_are_given():
  bad_visits = {"observation": {"logits": jnp.zeros((2, 3)), "value": jnp.zeros(2)},
                "visits": jnp.zeros((2, 4)), "return": jnp.zeros(2)}
  with pytest.raises(AssertionError, match="shape"):
    alphazero_loss(GIVEN, AlphaZeroConfig())({}, bad_visits)
  seq = {"observation": {"logits": jnp.zeros((2, 3, 2)), "value": jnp.zeros((2, 3))},
         "action": jnp.zeros((2, 3), jnp.int32), "reward": jnp.zeros((2, 3)),
         "discount": jnp.zeros((2, 3)), "valid": jnp.zeros((2, 2)), "log_prob": jnp.zeros((2, 3))}
  with pytest.raises(AssertionError, match="shape"):
    ppo_loss(GIVEN, PPOConfig())({}, seq)


def test_the_network_refuses_an_observation_of_another_encoding():
  from agents.networks import make_networks
  from environments.observations import DEFAULT_SIZES, observation_spec
  obs = {k: s.generate_value() for k, s in observation_spec(DEFAULT_SIZES._replace(
      nodes=256, edges=512, actions=64)).items()}
  nets = make_networks()
  params = nets.init(jax.random.PRNGKey(0), obs)
  assert nets.apply(params, obs).logits.shape == (64,)
  old = {**obs, "globals": obs["globals"][:-1]}      # a feature fewer
  with pytest.raises(AssertionError, match="shape"):
    nets.apply(params, old)

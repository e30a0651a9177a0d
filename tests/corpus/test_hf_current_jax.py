"""HuggingFace Flax models on whichever JAX runs the tests (`make test-current` runs this file
on current JAX, where the real-models tier's slow tests do not run)."""

import jax.numpy as jnp
import numpy as np

import corpus
import partitioner as P
from corpus.hf import _NumpyShim
from partitioner.verify import verify


def test_clip_takes_numpy_s_old_keywords_and_current_jax_s():
  x = jnp.arange(-3, 4)
  clip = _NumpyShim().clip
  expected = np.clip(np.arange(-3, 4), -1, 2)
  for got in (clip(x, a_min=-1, a_max=2), clip(x, min=-1, max=2), clip(x, -1, 2)):
    np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(clip(x, a_max=0), np.minimum(np.arange(-3, 4), 0))
  assert _NumpyShim().tanh is jnp.tanh     # everything else is jax.numpy's own


def test_hf_t5_traces_and_verifies_on_this_jax():
  """transformers' Flax T5 passes `a_max` to `jnp.clip`, which current JAX no longer takes:
  the step used to fail to trace there (TypeError deep inside transformers)."""
  workload = corpus.load("hf_t5:small")
  pp = P.apply(P.trace(workload.fn, *workload.args), "batch=8", "BatchParallel(batch)")
  result = verify(pp, workload.args)
  assert result.ok, result.max_abs_err


def test_hf_bloom_with_a_head_count_not_a_power_of_two_builds_and_verifies():
  """transformers' Flax BLOOM calls `jnp.cat` (PyTorch's name) for the ALiBi slopes of a head
  count that is not a power of two (BLOOM-176B's 112): an AttributeError on every JAX."""
  np.testing.assert_array_equal(_NumpyShim().cat([jnp.zeros(2), jnp.ones(1)]), [0, 0, 1])
  workload = corpus.load("hf_bloom:small,heads=6,d_model=96")
  pp = P.apply(P.trace(workload.fn, *workload.args), "batch=8", "BatchParallel(batch)")
  result = verify(pp, workload.args)
  assert result.ok, result.max_abs_err

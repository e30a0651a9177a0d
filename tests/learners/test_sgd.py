"""The SGD learner's update is all or nothing under a stop signal: applied, counted and logged
together, so a resumed run's version, counter and logs agree."""

import itertools
import os
import signal

import jax.numpy as jnp
import optax
import pytest

from agents.loggers import InMemoryLogger
from learners.sgd import SGDLearner


class _StopWhileLogging(InMemoryLogger):
  """Sends this process SIGTERM in the middle of writing the first record, as `kill` or a
  launcher stopping the learner would at the worst moment."""

  def write(self, data):
    if not self.data:
      os.kill(os.getpid(), signal.SIGTERM)
    super().write(data)


def test_a_stop_signal_lands_after_the_update_is_counted_and_logged():
  def stop(signum, frame):
    raise KeyboardInterrupt
  previous = signal.signal(signal.SIGTERM, stop)
  try:
    logger = _StopWhileLogging()
    learner = SGDLearner({"w": jnp.ones(3)},
                         lambda p, batch: (jnp.sum((p["w"] - batch["x"]) ** 2), {}),
                         optax.sgd(0.1), itertools.repeat({"x": jnp.zeros(3)}), logger=logger)
    with pytest.raises(KeyboardInterrupt):
      learner.step()
    # The stop arrived once the update was applied, counted and logged, not halfway.
    assert learner.version == 1 and learner.save()["counts"]["steps"] == 1
    assert [row["steps"] for row in logger.data] == [1]
    assert signal.getsignal(signal.SIGTERM) is stop     # the handler is back
  finally:
    signal.signal(signal.SIGTERM, previous)

"""What the corpus tests share."""

import pytest

import corpus
import partitioner as P


@pytest.fixture(scope="module")
def traced():
  """`traced(spec)`: the corpus entry's workload and its traced program, traced once per test
  module."""
  cache = {}

  def get(spec):
    if spec not in cache:
      workload = corpus.load(spec)
      cache[spec] = (workload, P.trace(workload.fn, *workload.args))
    return cache[spec]
  return get

"""relax_gc raises the young-generation threshold and never lowers one set higher."""

import gc

from launch.runtime import YOUNG_THRESHOLD, relax_gc


def test_relax_gc_raises_the_young_threshold_and_keeps_a_higher_one():
  before = gc.get_threshold()
  try:
    gc.set_threshold(700, before[1], before[2])
    relax_gc()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
    gc.set_threshold(2 * YOUNG_THRESHOLD, before[1], before[2])
    relax_gc()
    assert gc.get_threshold()[0] == 2 * YOUNG_THRESHOLD
  finally:
    gc.set_threshold(*before)

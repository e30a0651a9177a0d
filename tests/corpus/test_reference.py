"""The reference table agrees with what practitioners know, and marks the best strategy."""

import dataclasses

import pytest

from corpus import reference
from partitioner.cost import load_hardware

GIB = 2 ** 30


@pytest.mark.slow
def test_data_parallel_does_not_fit_gpt_6_7b_on_16_gib_devices_but_zero3_does():
  v100 = dataclasses.replace(load_hardware("tpu-v3"), name="16gib", hbm_bytes=16 * GIB)
  entries = {e.strategy: e for e in reference.evaluate_model(
      "gpt:6.7b,scan=True", "batch=8,model=4", v100, strategies=("dp", "zero3"))}
  assert entries["dp"].fits is False
  assert entries["dp"].peak_memory_bytes > 6.7e9 * 12  # weights, gradients and Adam's moments
  assert entries["zero3"].fits  # everything sharded 32 ways: 6.7e9 x 16 B / 32 + activations
  assert sum(e.best for e in entries.values()) == 1 and not entries["dp"].best


def _entry(model, strategy, t, fits, peak=1):
  return reference.Entry(model, "gpt", 1, strategy, "", t, t, 0.0, 0.0, peak, fits)


def test_best_is_the_fastest_that_fits_else_the_closest_to_fitting():
  entries = reference.mark_best([
      _entry("a", "fast-but-too-big", 1.0, False), _entry("a", "fits", 2.0, True),
      _entry("a", "slow", 3.0, True), _entry("b", "x", 5.0, False), _entry("b", "y", 4.0, False),
      reference.Entry("b", "gpt", 1, "n/a", "", None, None, None, None, None, None, "no"),
      _entry("d", "fast", 1.0, False, peak=10), _entry("d", "small", 2.0, False, peak=5)])
  assert [e.strategy for e in entries if e.best] == ["fits", "y", "small"]
  assert reference.best(entries, "a").strategy == "fits"
  assert reference.best(entries, "c") is None


def test_inapplicable_strategies_are_reported_not_raised():
  entries = reference.evaluate_model("gpt:small,batch=32", "batch=1,model=32", "h100",
                                     strategies=("dp", "dp+sp"))
  by_name = {e.strategy: e for e in entries}
  assert by_name["dp"].step_time_s > 0 and by_name["dp"].best
  assert by_name["dp+sp"].step_time_s is None and not by_name["dp+sp"].best
  assert "length 16 along dim 1, not divisible by model=32" in by_name["dp+sp"].error


def test_unknown_models_fail_before_any_work():
  with pytest.raises(Exception, match="unknown model family 'gtp'"):
    reference.reference_table(["gpt:small", "gtp:small"], "batch=2,model=4", "h100")

"""The GPU step-time benchmark's round trip, run on CPU: a program exported as StableHLO comes
back as a callable that computes what the original computes, and the report joins it with the
simulator's prediction."""

import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import gpu_step_times  # noqa: E402


def test_export_measure_render_round_trip(tmp_path):
  model = "mlp:small"
  gpu_step_times.export(tmp_path, [model], "h100", "cpu")
  meta = json.loads((tmp_path / "mlp_small.json").read_text())
  assert meta["predicted"]["flops"] > 0 and meta["predicted"]["kernels"] > 0
  assert meta["predicted"]["matmul_kernels_s"] > 0

  # The bytecode, rebuilt into an Exported, computes the training step.
  import corpus
  workload = corpus.load(model, abstract=False)
  leaves = jax.tree.leaves(workload.args)
  exported = gpu_step_times._exported(jax, meta, (tmp_path / "mlp_small.mlirbc").read_bytes(),
                                      "cpu")
  got = exported.call(*leaves)
  want = jax.tree.leaves(jax.jit(workload.fn)(*workload.args))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)

  out = tmp_path / "measured.json"
  gpu_step_times.measure(tmp_path, out, repeat=2, ceiling_size=256)
  measured = json.loads(out.read_text())
  row = measured["models"][model]
  assert row["step_s"] > 0 and row["xla_footprint"] > 0, row
  text = gpu_step_times.render(gpu_step_times.join(tmp_path, measured))
  assert "| mlp:small |" in text and "geometric mean" in text

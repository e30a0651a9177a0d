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


def test_a_trace_splits_matmul_kernels_from_the_rest_per_step():
  times = {"runs": 2, "lines": {"/device:GPU:0 Stream #14": {
      "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32": [4, 6e6],
      "gemm_fusion_dot_31": [2, 2e6],                       # XLA's Triton GEMM
      "sm90_xmma_fprop_implicit_gemm_f32f32": [2, 1e6],     # a cuDNN convolution
      "loop_convert_fusion": [6, 3e6],                      # not a convolution
      "input_reduce_fusion_8": [2, 1e6]}}}
  summary = gpu_step_times.trace_summary(times)
  assert summary == {"kernels": 8, "matmul_s": 4.5e-3, "other_s": 2e-3}


def test_the_table_shows_the_trace_beside_the_prediction_and_repredicts(tmp_path):
  predicted = {"step_s": 2e-3, "compute_s": 2e-3, "flops": 1e9, "hbm_bytes": 1e6,
               "peak_bytes": 10, "argument_bytes": 5, "matmul_kernels_s": 1e-3,
               "other_kernels_s": 1e-3, "kernels": 12}
  measured = {"step_s": 4e-3, "xla_bytes_accessed": 2e6, "xla_footprint": 20,
              "trace": {"kernels": 9, "matmul_s": 1.5e-3, "other_s": 2e-3}}
  table = {"device": "a GPU", "jax": "0.0", "ceilings": {"copy_tb_s": 1.0},
           "rows": [{"model": "mlp:small", "ops": 1, "hardware": "h100",
                     "predicted": predicted, "measured": measured},
                    {"model": "hf_gpt2:mini", "ops": 1, "hardware": "h100",
                     "predicted": predicted, "measured": dict(measured, trace=None)}]}
  text = gpu_step_times.render(table)
  assert "| mlp:small | 4.00 | 2.00 | 0.50 | 1.0 / 1.5 | 1.0 / 2.0 | 12 / 9 |" in text
  assert "| hf_gpt2:mini | 4.00 | 2.00 | 0.50 | 1.0 / n/a | 1.0 / n/a | 12 / n/a |" in text
  assert gpu_step_times.NOTES["hf_gpt2:mini"] in text
  path = tmp_path / "table.json"
  path.write_text(json.dumps(table))
  again = gpu_step_times.repredict(path)
  assert again["rows"][0]["measured"] == measured          # the measurements stand
  assert 0 < again["rows"][0]["predicted"]["flops"] != 1e9   # the simulator's own figures
  assert again["rows"][0]["predicted"]["kernels"] > 0


def test_a_rewritten_program_exports_and_renders_beside_its_uncut_row(tmp_path):
  """`MODEL | TACTICS`: the partitioner's program (here cut into micro-batches, with a
  checkpointed block whose barrier must survive) exported as it runs, computing the step."""
  import corpus
  model = "gpt:small,remat=true"
  specs = [f"{model} | ", f"{model} | Microbatch(2)"]
  gpu_step_times.export(tmp_path, specs, "h100", "cpu")
  import partitioner as P
  workload = corpus.load(model, abstract=False)
  leaves = jax.tree.leaves(workload.args)
  program = P.trace(workload.fn, *workload.args)
  for spec, tactics in zip(specs, ("", "Microbatch(2)")):
    path = tmp_path / f"{gpu_step_times.slug(spec)}.json"
    meta = json.loads(path.read_text())
    bytecode = path.with_suffix(".mlirbc").read_bytes()
    assert b"optimization_barrier" in bytecode
    got = gpu_step_times._exported(jax, meta, bytecode, "cpu").call(*leaves)
    rewrite = P.apply(program, "batch=1", tactics).program   # what the export runs
    want = jax.jit(lambda *xs: list(rewrite.evaluate(*xs)))(*leaves)
    if not tactics:   # uncut, the user's own step
      want = jax.tree.leaves(jax.jit(workload.fn)(*workload.args))
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
  out = tmp_path / "measured.json"
  gpu_step_times.measure(tmp_path, out, repeat=1, ceiling_size=256, trace_runs=1)
  text = gpu_step_times.render(gpu_step_times.join(tmp_path, json.loads(out.read_text())))
  assert "## Micro-batched steps on one GPU" in text and "## Step time on one GPU" not in text
  assert f"| {model} | 1 |" in text and f"| {model} | 2 |" in text
  assert "1.00, 1.00" in text     # the uncut row over itself


def test_a_users_module_function_exports_with_its_own_arguments(tmp_path):
  """Integer bounds come from the corpus' initialisation only for corpus models; a user's
  `path.py:function` brings its arguments, and exports (whole and cut) as the corpus does."""
  model = str(Path(__file__).resolve().parents[2] / "launch" / "user_model.py") + ":workload"
  gpu_step_times.export(tmp_path, [model, f"{model} | Microbatch(2)"], "h100", "cpu")
  metas = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
  assert len(metas) == 2 and all(m["predicted"]["flops"] > 0 for m in metas)
  assert all(len(m["int_max"]) == len(m["inputs"]) for m in metas)

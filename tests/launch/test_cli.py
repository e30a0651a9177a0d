"""`shardzero partition`: tables, JSON, verification, XLA comparison, one-line errors."""

import json
import os
import re
import subprocess
import sys

import pytest

from launch.cli import main

USER = "tests/launch/user_model.py:workload"


def run(capsys, *argv):
  code = main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.slow
def test_partition_prints_shardings_collectives_and_verifies(capsys):
  code, out, _ = run(capsys, "partition", "gpt:small", "--mesh", "batch=2,model=4", "--tactics",
                     "BatchParallel(batch); Megatron(model)", "--verify")
  assert code == 0
  assert "params/gpt/layer_*/w_in/w" in out and "[-, model]" in out
  assert "all-reduce" in out and "verify: OK" in out
  assert ("partial sums deferred: 8 partial results carried through linear ops and reduced by "
          "3 all-reduces where they meet") in out


def test_partition_json_has_the_documented_fields(capsys, tmp_path):
  path = tmp_path / "r.json"
  code, _, _ = run(capsys, "partition", "mlp:small", "--mesh", "batch=4,model=2", "--tactics",
                   "BatchParallel(batch); Megatron(model)", "--verify", "--json", str(path))
  data = json.loads(path.read_text())
  assert code == 0
  assert data["strategy"] == "BatchParallel(batch); Megatron(model)"
  assert data["shardings"]["params/mlp/layer_0/w"] == [None, "model"]
  assert data["shardings"]["batch/x"] == ["batch"]
  assert {"kind", "axes", "bytes"} <= set(data["collectives"][0])
  assert data["fallbacks"] == [] and data["verified"] is True and data["max_abs_err"] < 1e-4


def test_partition_json_to_stdout_with_xla_side_by_side(capsys):
  code, out, _ = run(capsys, "partition", USER, "--mesh", "a=8", "--tactics",
                     "BatchParallel(a)", "--xla", "--json", "-")
  data = json.loads(out)
  assert code == 0
  assert [c["kind"] for c in data["collectives"]] == ["all-reduce"] * 3  # loss, 2 gradients
  assert sum(c["bytes"] for c in data["xla_collectives"] if not c["from_constant"]) == sum(
      c["bytes"] for c in data["collectives"])


def test_partition_xla_table(capsys):
  code, out, _ = run(capsys, "partition", USER, "--mesh", "a=8", "--tactics", "BatchParallel(a)",
                     "--xla")
  assert code == 0 and "partitioner vs XLA" in out


@pytest.mark.parametrize("argv,message", [
    (["mlp:small", "--mesh", "batch=8", "--tactics", "BatchParallel(model)"],
     "unknown mesh axis 'model'"),
    (["mlp:small", "--mesh", "batch=3", "--tactics", "BatchParallel(batch)"],
     "batch/x: dimension 0 of size 32 is not divisible by batch=3"),
    (["mlp:small", "--mesh", "batch=8", "--tactics", "Tile(params/nothing/*, 0, batch)"],
     "pattern 'params/nothing/*' matches no input or output"),
    (["no_such_module:fn", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "'no_such_module' is neither a corpus family (mlp, gpt, bert, vit, resnet, gnn, vmoe, t5, "
     "moe, unet, ssm, hf_gpt2, hf_bert, hf_t5, hf_vit, hf_llama, hf_mistral, hf_opt, hf_gptneo, "
     "hf_bart, hf_roberta, hf_bloom, hf_gemma) nor an importable module"),
    (["json.no_such:fn", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "no module 'json.no_such'"),
    (["tests/launch/missing.py:fn", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "no such file"),
    (["tests/launch/user_model.py:not_a_workload", "--mesh", "a=2", "--tactics",
      "BatchParallel(a)"], "must return (fn, example_args)"),
    (["tests/launch/user_model.py:raises", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "tests/launch/user_model.py:raises failed: RuntimeError: no data here"),
    (["tests/launch/user_model.py:step_raises", "--mesh", "a=2", "--tactics",
      "BatchParallel(a)"], "tracing step failed: KeyError: 'labels'"),
    (["hf_gpt2:small,style=keras", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "style must be one of named, short, train_state"),
    (["gpt:huge", "--mesh", "a=2", "--tactics", "BatchParallel(a)"], "gpt has no preset 'huge'"),
    (["gpt:small,depth=3", "--mesh", "a=2", "--tactics", "BatchParallel(a)"],
     "gpt has no knob 'depth'"),
    (["mlp:small", "--mesh", "batch", "--tactics", "BatchParallel(batch)"], "bad mesh 'batch'"),
    (["mlp:small", "--mesh", "batch=8", "--tactics", "Interleave(batch)"],
     "unknown tactic 'Interleave'"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
  code, out, err = run(capsys, "partition", *argv)
  assert code == 2
  assert err.count("\n") == 1 and message in err, err
  assert err.startswith("shardzero partition: error: ")


def test_partition_help_lists_every_tactic():
  from launch.partition_command import DESCRIPTION
  from partitioner.tactics import TACTICS
  assert [name for name in TACTICS if f"  {name}(" not in DESCRIPTION] == []


@pytest.mark.slow
def test_console_script_help_and_exit_code():
  env = dict(os.environ)
  exe = os.path.join(os.path.dirname(sys.executable), "shardzero")
  done = subprocess.run([exe, "partition", "--help"], capture_output=True, text=True, env=env)
  assert done.returncode == 0 and "Tactics (separated by ';')" in done.stdout
  done = subprocess.run([exe, "partition", "mlp:small", "--mesh", "batch=8", "--tactics",
                         "Megatron(batch)"], capture_output=True, text=True, env=env)
  # The MLP's widths divide by 8, so Megatron works on any axis name.
  assert done.returncode == 0, done.stderr
  done = subprocess.run([exe, "partition", "mlp:small", "--mesh", "x=8", "--tactics",
                         "Megatron(model)"], capture_output=True, text=True, env=env)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines() == [
      "shardzero partition: error: unknown mesh axis 'model'; the mesh has x"]


@pytest.mark.slow
def test_partition_reports_the_cost_on_the_chosen_hardware(capsys):
  code, out, _ = run(capsys, "partition", "gpt:1.3b,scan=True", "--mesh", "batch=8,model=8",
                     "--tactics", "BatchParallel(batch); Megatron(model)", "--hardware", "h100",
                     "--json", "-")
  cost = json.loads(out)["cost"]
  assert code == 0
  assert {"step_time_s", "compute_s", "comm_s", "peak_memory_bytes", "fits",
          "decompositions"} <= set(cost)
  assert cost["hardware"] == "h100" and cost["fits"] is True
  assert cost["placement"] == {"batch": "inter", "model": "intra"}
  # Megatron's all-reduces inside a node, the gradients' across it with one GPU per node.
  assert all(re.fullmatch(r"(ring|tree) all-reduce, (LL|LL128|Simple) \((NVLink|InfiniBand)\)",
                          d["decomposition"]) for d in cost["decompositions"])
  code, out, _ = run(capsys, "partition", "gpt:1.3b,scan=True", "--mesh", "batch=8,model=8",
                     "--tactics", "BatchParallel(batch); Megatron(model)", "--order",
                     "model,batch")
  assert code == 0 and "predicted on h100 (batch: intra, model: inter)" in out
  assert "does not fit" not in out and "memory per device: peak" in out


@pytest.mark.slow
def test_large_meshes_are_simulated_without_devices(capsys):
  code, out, _ = run(capsys, "partition", "gpt:1.3b,scan=True", "--mesh", "data=64,model=8",
                     "--tactics", "BatchParallel(data); Megatron(model)", "--hardware", "tpu-v4",
                     "--json", "-")
  assert code == 0 and json.loads(out)["cost"]["step_time_s"] > 0


def test_hardware_lists_the_catalog_and_shows_a_spec(capsys):
  code, out, _ = run(capsys, "hardware")
  assert code == 0 and "tpu-v5p" in out and "a100-40gb" in out and "InfiniBand" in out
  code, out, _ = run(capsys, "hardware", "--show", "h100")
  assert code == 0 and out.startswith("name: h100\n") and "node_size: 8" in out


@pytest.mark.parametrize("argv,message", [
    (["--hardware", "h900"], "unknown hardware 'h900'"),
    (["--hardware", "tests/launch/user_model.py"], "unknown hardware"),
    (["--order", "batch,nothing"], "must name each mesh axis"),
])
def test_bad_hardware_is_one_line_and_exit_code_2(capsys, argv, message):
  code, _, err = run(capsys, "partition", "mlp:small", "--mesh", "batch=8", "--tactics",
                     "BatchParallel(batch)", *argv)
  assert code == 2 and message in err and err.count("\n") == 1


def test_corpus_lists_families_splits_and_experts(capsys):
  code, out, _ = run(capsys, "corpus")
  assert code == 0
  for family in ("mlp", "gpt", "t5", "bert", "vit", "vmoe", "moe", "resnet", "unet", "gnn", "ssm"):
    assert f" {family} " in out
  assert "heldout" in out and "dp+ep" in out
  code, out, _ = run(capsys, "corpus", "--split", "heldout", "--json", "-")
  data = json.loads(out)
  assert set(data) == {"t5", "moe", "unet", "ssm"}
  assert data["moe"]["knobs"]["experts"] == 4 and "gshard" in data["moe"]["experts"]
  assert data["moe"]["experts"]["gshard"]["schedule"] == (
      "BatchParallel(batch); ExpertParallel(model); BatchParallel(model)")
  assert "GShard" in data["moe"]["experts"]["gshard"]["description"]


def test_corpus_table_marks_the_best_and_writes_json(capsys, tmp_path):
  path = tmp_path / "table.json"
  code, out, _ = run(capsys, "corpus", "--table", "--models", "mlp:small;gpt:small,layers=1",
                     "--mesh", "batch=2,model=4", "--hardware", "h100", "--json", str(path))
  assert code == 0
  assert "mlp:small" in out and "gpt:small,layers=1" in out and "* " in out
  data = json.loads(path.read_text())
  assert data["mesh"] == "batch=2,model=4" and data["hardware"] == "h100"
  entries = data["entries"]
  assert {e["model"] for e in entries} == {"mlp:small", "gpt:small,layers=1"}
  for model in ("mlp:small", "gpt:small,layers=1"):
    mine = [e for e in entries if e["model"] == model]
    assert sum(e["best"] for e in mine) == 1
    best = next(e for e in mine if e["best"])
    assert best["step_time_s"] == min(e["step_time_s"] for e in mine if e["fits"])
  assert {"strategy", "schedule", "step_time_s", "peak_memory_bytes", "fits"} <= set(entries[0])


def test_corpus_table_scales_the_global_batch(capsys):
  code, out, _ = run(capsys, "corpus", "--table", "--models", "mlp:small", "--mesh", "batch=16",
                     "--global-batch", "64", "--json", "-")
  entries = json.loads(out)["entries"]
  assert code == 0 and {e["model"] for e in entries} == {"mlp:small,batch=64"}
  assert all(e["error"] is None for e in entries)


@pytest.mark.parametrize("argv,message", [
    (["corpus", "--table", "--models", "mlp:small", "--global-batch", "0"], "must be positive"),
    (["corpus", "--table", "--models", "gtp:small"], "unknown model family 'gtp'"),
    (["corpus", "--table", "--models", "mlp:small", "--mesh", "batch=x"], "batch=x"),
    (["corpus", "--table", "--models", "mlp:small", "--hardware", "tpu-v9"], "tpu-v9"),
])
def test_corpus_table_bad_input_is_one_line(capsys, argv, message):
  code, _, err = run(capsys, *argv)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1

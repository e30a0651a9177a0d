"""Bad input anywhere is one line on stderr and exit code 2, never a traceback: a table of what
users get wrong, across the commands."""

import importlib.util
import json

import pytest

from tests.launch.test_cli import run

SPEC = """name: mine
description: a machine
peak_flops: {float32: 1.0e12}
hbm_bytes: 1000000
hbm_bandwidth: BANDWIDTH
node_size: 8
intra: {name: a, bandwidth: 1.0e9, latency: 1.0e-6}
inter: {name: b, bandwidth: 1.0e9, latency: 1.0e-6}
"""
TRAIN_EXTRA = importlib.util.find_spec("reverb") is not None
PARTITION = ["partition", "mlp:small", "--mesh", "batch=8", "--tactics", "BatchParallel(batch)"]


def _files(tmp):
  (tmp / "missing.yaml").write_text("name: mine\n")
  (tmp / "negative.yaml").write_text(SPEC.replace("BANDWIDTH", "-5"))
  (tmp / "broken.yaml").write_text("name: [unclosed\n")
  old = tmp / "old_run"
  old.mkdir()
  (old / "config.json").write_text(json.dumps({"algorithm": "ppo", "settings": {"gone": 3}}))
  pickled = tmp / "pickled_run"
  pickled.mkdir()
  (pickled / "config.json").write_text("{}")
  (pickled / "checkpoint.pkl").write_bytes(b"SHARDZERO-CKPT-1\n0\n")


CASES = [  # (argv with {tmp}, what the one line says)
    (PARTITION + ["--hardware", "{tmp}/missing.yaml"], "missing field(s)"),
    (PARTITION + ["--hardware", "{tmp}/negative.yaml"], "hbm_bandwidth must be positive"),
    (PARTITION + ["--hardware", "{tmp}/broken.yaml"], "not valid YAML"),
    (PARTITION + ["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["propose", "mlp:small", "--mesh", "batch=8", "--policy", "{tmp}/old_run"],
     "unknown ppo settings ['gone']"),
    (["propose", "mlp:small", "--mesh", "batch=8", "--policy", "{tmp}/pickled_run"],
     "pickled checkpoint"),
    (["propose", "mlp:small", "--mesh", "batch=8", "--policy", "{tmp}/nowhere"],
     "is not a training run"),
    (["propose", "mlp:small", "--mesh", "batch=8", "--memory-margin", "1.5"],
     "--memory-margin must be in [0, 1)"),
    (["train", "--run-dir", "{tmp}/r1", "--set", "nonsense=1"], "unknown ppo settings"),
    (["train", "--run-dir", "{tmp}/r2", "--set", "learning_rate=fast"],
     "learning_rate takes a float"),
    (["train", "--run-dir", "{tmp}/r3", "--set", "batch_size=2.5"], "batch_size takes an int"),
    (["train", "--run-dir", "{tmp}/r4", "--set", "learning_rate"], "--set takes KEY=VALUE"),
    (["train", "--run-dir", "{tmp}/r9", "--batch-per-device", "0"],
     "--batch-per-device takes positive counts"),
    (["train", "--run-dir", "{tmp}/r9b", "--batch-per-device", "2,one"],
     "--batch-per-device takes positive counts separated by ',', got '2,one'"),
    (["train", "--run-dir", "{tmp}/r10", "--budgets", "device,tight"],
     "--budgets takes 'device' or fractions, got 'tight'"),
    (["train", "--run-dir", "{tmp}/r11", "--budgets", "0.5,-1.5"],
     "budget fractions are above -1 and not 0, got -1.5"),
    (["partition", "mlp:small", "--mesh", "batch=8", "--tactics", "BatchParallel(batch"],
     "cannot parse tactic"),
    (["partition", "gpt:small,wings=3", "--mesh", "batch=8", "--tactics", "BatchParallel(batch)"],
     "gpt has no knob 'wings'"),
    (["partition", "gpt:huge", "--mesh", "batch=8", "--tactics", "BatchParallel(batch)"],
     "preset"),
    (["partition", "mlp:small", "--mesh", "batch=8", "--tactics", "Megatron(nope)"],
     "unknown mesh axis 'nope'"),
    (["partition", "mlp:small", "--mesh", "batch=8", "--tactics", "Tile(params/nothing, 0, batch)"],
     "params/nothing"),
    (["partition", "mlp:small", "--mesh", "batch=3", "--tactics", "BatchParallel(batch)"],
     "not divisible"),
    (["partition", "mlp:small", "--mesh", "batch", "--tactics", "BatchParallel(batch)"],
     "mesh"),
    (["search", "mlp:small", "--mesh", "batch=8", "--memory-budget", "lots"], "lots"),
    (["evaluate", "--models", "mlp:small", "--meshes", "batch=8", "--agents", "alphago"],
     "unknown agent 'alphago'"),
    (["train", "--run-dir", "{tmp}/r5", "--launcher", "ray", "--role", "actor"],
     "leave out --role"),
    (["train", "--run-dir", "{tmp}/r6", "--address", "auto"], "settings of --launcher ray"),
    (["train", "--run-dir", "{tmp}/r7", "--launcher", "ray", "--learner-resources", "GPU"],
     "NAME=AMOUNT"),
    (["train", "--run-dir", "{tmp}/r8", "--launcher", "ray", "--address", "127.0.0.1:1"],
     # where Reverb is not installed (current JAX), that is what the run lacks first
     "no Ray cluster answers at 127.0.0.1:1" if TRAIN_EXTRA else "needs the `train` extra"),
    (["evaluate", "--models", "mlp:small", "--meshes", "batch=8", "--address", "auto"],
     "--address is a setting of --launcher ray"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
  _files(tmp_path)
  code, out, err = run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
  lines = [l for l in err.splitlines() if l.strip()]
  assert code == 2, err
  assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
  assert message in lines[0], lines[0]


def test_training_without_its_extra_says_how_to_get_it(capsys, tmp_path, monkeypatch):
  """On current JAX the `train` extra (Reverb, TensorFlow 2.15, rlax) cannot be installed:
  `train` says so in one line once its command line is known to be good."""
  import importlib.util
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "reverb" else find_spec(name, *a))
  code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "run"), "--steps", "1")
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert "needs the `train` extra (reverb" in err and "constraints.txt" in err

"""Checkpoints cannot run code: the format round-trips trees of arrays without pickle, and a
pickle placed where a checkpoint is expected is refused without being executed."""

import hashlib
import io
import os
import pickle
import subprocess
import sys
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from learners import checkpointing


class _State(NamedTuple):
  params: dict
  steps: np.ndarray
  average: object = None


def test_a_tree_round_trips_with_its_dtypes_and_scalars(tmp_path):
  tree = {"learner": {"state": _State({"w": np.arange(6.0, dtype=np.float32).reshape(2, 3),
                                       "b16": jnp.ones(4, jnp.bfloat16)}, np.int32(7)),
                      "counts": {"steps": 3.0, "episodes": 12}},
          "config": {"name": "run", "sizes": (4096, 8192, 512), "lr": 1e-3, "none": None,
                     "flags": [True, False]}}
  path = str(tmp_path / checkpointing.FILENAME)
  checkpointing.save(path, tree)
  back = checkpointing.load(str(tmp_path))
  state = back["learner"]["state"]
  assert isinstance(state, tuple) and len(state) == 3 and state[2] is None
  np.testing.assert_array_equal(state[0]["w"], tree["learner"]["state"].params["w"])
  assert state[0]["b16"].dtype == jnp.bfloat16 and state[0]["b16"].tolist() == [1, 1, 1, 1]
  assert int(state[1]) == 7 and state[1].dtype == np.int32
  assert back["learner"]["counts"] == {"steps": 3.0, "episodes": 12}
  assert back["config"] == {"name": "run", "sizes": (4096, 8192, 512), "lr": 1e-3,
                            "none": None, "flags": [True, False]}
  assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]   # written atomically


class _Exploit:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["old name", "new name", "inside the npz"])
def test_a_crafted_pickle_is_refused_and_never_run(tmp_path, where):
  marker = tmp_path / "pwned"
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "config.json").write_text("{}")   # a run directory as `propose` expects one
  body = pickle.dumps({"learner": _Exploit(marker)})
  if where == "inside the npz":   # an object array: np.load would unpickle it if allowed
    buffer = io.BytesIO()
    np.savez(buffer, a0=np.array([_Exploit(marker)], dtype=object),
             __structure__=np.frombuffer(b'{"array": 0, "dtype": "object"}', np.uint8))
    raw = buffer.getvalue()
    raw = checkpointing.MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw
    name = checkpointing.FILENAME
  else:   # the old format's header, with a checksum that matches: the attacker can compute it
    raw = checkpointing.PICKLED_MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    name = checkpointing.PICKLED_FILENAME if where == "old name" else checkpointing.FILENAME
  (run_dir / name).write_bytes(raw)
  with pytest.raises(checkpointing.CheckpointError) as e:
    checkpointing.load(str(run_dir))
  if where != "inside the npz":
    assert "pickled checkpoint" in str(e.value) and "convert-checkpoint" in str(e.value)
  else:
    assert "cannot be read" in str(e.value)
  assert not marker.exists()
  # The commands that load policies refuse it the same way (one line, exit 2).
  result = subprocess.run([sys.executable, "-m", "launch.cli", "propose", "mlp:small",
                           "--mesh", "batch=8", "--policy", str(run_dir)],
                          capture_output=True, text=True, cwd=os.getcwd(), timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert ("pickled checkpoint" if where != "inside the npz" else "cannot be read") in \
      result.stderr, result.stderr[-2000:]
  assert not marker.exists()


def test_converter_turns_a_trusted_pickled_checkpoint_into_the_safe_format(tmp_path):
  data = {"learner": {"state": (np.ones(3, np.float32), np.int32(2)), "counts": {"steps": 2.0}}}
  body = pickle.dumps(data)
  raw = checkpointing.PICKLED_MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
  (tmp_path / checkpointing.PICKLED_FILENAME).write_bytes(raw)
  assert checkpointing.is_pickled_run(str(tmp_path))
  out = checkpointing.convert_pickled(str(tmp_path))
  assert out == str(tmp_path / checkpointing.FILENAME)
  back = checkpointing.load(str(tmp_path))
  np.testing.assert_array_equal(back["learner"]["state"][0], np.ones(3))
  assert back["learner"]["counts"] == {"steps": 2.0}


def test_things_that_are_not_data_are_refused_when_saving(tmp_path):
  with pytest.raises(checkpointing.CheckpointError, match="cannot checkpoint"):
    checkpointing.save(str(tmp_path / "x"), {"f": object()})

"""Checkpoints of a run: a pickled tree of numpy arrays behind a header with its SHA-256, written
to a temporary file and renamed, so a crash mid-write leaves the previous checkpoint intact
and a damaged file is reported rather than half-loaded."""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

import jax
import numpy as np

from partitioner.errors import ShardzeroError

MAGIC = b"SHARDZERO-CKPT-1\n"
FILENAME = "checkpoint.pkl"


class CheckpointError(ShardzeroError):
  """A checkpoint that is missing, damaged or of another kind."""


def save(path: str, data: Any) -> None:
  data = jax.tree_util.tree_map(np.asarray, data)
  body = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def load(path: str) -> Any:
  if os.path.isdir(path):
    path = os.path.join(path, FILENAME)
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path}")
  with open(path, "rb") as f:
    raw = f.read()
  if not raw.startswith(MAGIC):
    raise CheckpointError(f"{path} is not a shardzero checkpoint")
  digest, _, body = raw[len(MAGIC):].partition(b"\n")
  if hashlib.sha256(body).hexdigest().encode() != digest:
    raise CheckpointError(f"{path} is damaged (its checksum does not match); "
                          "delete it to start over, or restore a copy")
  try:
    return pickle.loads(body)
  except Exception as e:  # a matching checksum with an unreadable body: another version
    raise CheckpointError(f"{path} cannot be read: {e}") from None

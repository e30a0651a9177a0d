"""Checkpoints of a run, in a format that cannot run code when loaded.

The file is a header (a magic line and the SHA-256 of the body) and a body that is an `.npz`
archive: every array of the saved tree, and the tree's structure as JSON (dicts, lists,
tuples, None, numbers and strings; a NamedTuple is stored as a tuple). It is read with
`np.load(allow_pickle=False)` and `json.loads`, so nothing in it can name a class or a
function to call. It is written to a temporary file and renamed, so a crash mid-write leaves
the previous checkpoint intact, and a damaged file is reported rather than half-loaded.

Checkpoints of shardzero before this format were pickles, which run code on load; they are
refused with the command that converts one (`shardzero convert-checkpoint`), to be run only
on a file whose source is trusted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import numpy as np

from partitioner.errors import ShardzeroError

MAGIC = b"SHARDZERO-CKPT-2\n"
PICKLED_MAGIC = b"SHARDZERO-CKPT-1\n"   # the old, pickled format
FILENAME = "checkpoint.ckpt"
PICKLED_FILENAME = "checkpoint.pkl"
_STRUCTURE = "__structure__"


class CheckpointError(ShardzeroError):
  """A checkpoint that is missing, damaged, unsafe or of another kind."""


def _encode(tree, arrays: list) -> Any:
  """The JSON node of a tree; arrays are appended to `arrays` and named by position."""
  if tree is None:
    return {"none": True}
  if isinstance(tree, dict):
    return {"dict": [[_key(k), _encode(v, arrays)] for k, v in tree.items()]}
  if isinstance(tree, (list, tuple)):
    kind = "list" if isinstance(tree, list) else "tuple"
    return {kind: [_encode(v, arrays) for v in tree]}
  if isinstance(tree, (bool, int, float, str)) and not isinstance(tree, np.generic):
    return {"value": tree}
  array = np.asarray(tree)
  if array.dtype == object:
    raise CheckpointError(f"cannot checkpoint a {type(tree).__name__}: only arrays, numbers, "
                          "strings and containers of them")
  dtype = array.dtype.name
  if array.dtype.kind == "V" or dtype not in np.sctypeDict:   # bfloat16 and other ml_dtypes
    array = array.view(f"u{array.dtype.itemsize}")
  arrays.append(array)
  return {"array": len(arrays) - 1, "dtype": dtype}


def _key(k):
  if not isinstance(k, (str, int)) or isinstance(k, bool):
    raise CheckpointError(f"cannot checkpoint a dict key of type {type(k).__name__}")
  return k


def _decode(node, arrays) -> Any:
  if "none" in node:
    return None
  if "dict" in node:
    return {k: _decode(v, arrays) for k, v in node["dict"]}
  if "list" in node:
    return [_decode(v, arrays) for v in node["list"]]
  if "tuple" in node:
    return tuple(_decode(v, arrays) for v in node["tuple"])
  if "value" in node:
    return node["value"]
  array = arrays[f"a{node['array']}"]
  if array.dtype.name != node["dtype"]:
    import jax.numpy as jnp   # ml_dtypes' types, by name
    array = array.view(jnp.dtype(node["dtype"]))
  return array


def dumps(data: Any) -> bytes:
  """The checkpoint file's bytes for `data` (a tree of arrays, numbers, strings, containers)."""
  import jax
  data = jax.tree_util.tree_map(lambda x: np.asarray(x) if hasattr(x, "__array__") else x, data)
  arrays: list = []
  structure = json.dumps(_encode(data, arrays)).encode()
  buffer = io.BytesIO()
  np.savez(buffer, **{f"a{i}": a for i, a in enumerate(arrays)},
           **{_STRUCTURE: np.frombuffer(structure, np.uint8)})
  body = buffer.getvalue()
  return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def save(path: str, data: Any) -> None:
  raw = dumps(data)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(raw)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _convert_hint(path: str) -> str:
  return (f"{path} is a pickled checkpoint of an earlier shardzero; loading a pickle can run "
          "any code its author put in it, so it is not loaded. If you trust where it came from, "
          f"convert it once with: shardzero convert-checkpoint {path}")


def is_pickled_run(run_dir: str) -> bool:
  """Whether a run directory holds only a checkpoint in the old, pickled format."""
  return (not os.path.exists(os.path.join(run_dir, FILENAME)) and
          os.path.exists(os.path.join(run_dir, PICKLED_FILENAME)))


def path_of(run_dir: str) -> str:
  """The checkpoint file of a run directory; a clear error if it has none or only a pickled
  one."""
  if is_pickled_run(run_dir):
    raise CheckpointError(_convert_hint(os.path.join(run_dir, PICKLED_FILENAME)))
  path = os.path.join(run_dir, FILENAME)
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint {path} (train one with 'shardzero train')")
  return path


def load(path: str) -> Any:
  """The tree saved at `path` (a checkpoint file or a run directory). NamedTuples come back
  as tuples."""
  if os.path.isdir(path):
    path = path_of(path)
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path}")
  with open(path, "rb") as f:
    raw = f.read()
  if raw.startswith(PICKLED_MAGIC):
    raise CheckpointError(_convert_hint(path))
  if not raw.startswith(MAGIC):
    raise CheckpointError(f"{path} is not a shardzero checkpoint")
  digest, _, body = raw[len(MAGIC):].partition(b"\n")
  if hashlib.sha256(body).hexdigest().encode() != digest:
    raise CheckpointError(f"{path} is damaged (its checksum does not match); "
                          "delete it to start over, or restore a copy")
  try:
    with np.load(io.BytesIO(body), allow_pickle=False) as archive:
      arrays = {name: archive[name] for name in archive.files}
    structure = json.loads(arrays.pop(_STRUCTURE).tobytes())
    return _decode(structure, arrays)
  except Exception as e:  # a matching checksum with an unreadable body (or object arrays)
    raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None


def convert_pickled(path: str) -> str:
  """Converts a pickled checkpoint (a file, or a run directory holding one) to this format,
  beside it. This unpickles the file: only for files whose source is trusted. Returns the
  path written."""
  import pickle
  if os.path.isdir(path):
    path = os.path.join(path, PICKLED_FILENAME)
  if not os.path.exists(path):
    raise CheckpointError(f"no checkpoint at {path}")
  with open(path, "rb") as f:
    raw = f.read()
  if not raw.startswith(PICKLED_MAGIC):
    raise CheckpointError(f"{path} is not a pickled shardzero checkpoint")
  digest, _, body = raw[len(PICKLED_MAGIC):].partition(b"\n")
  if hashlib.sha256(body).hexdigest().encode() != digest:
    raise CheckpointError(f"{path} is damaged (its checksum does not match)")
  data = pickle.loads(body)   # the user asked for this, knowing the file's source
  out = os.path.join(os.path.dirname(path), FILENAME)
  save(out, data)
  return out

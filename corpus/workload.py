"""A workload: a JAX function and example arguments, as the partitioner takes them."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from partitioner.errors import WorkloadError
from partitioner.tracing import is_array


class Workload(NamedTuple):
  name: str
  fn: Callable
  args: tuple  # arrays or jax.ShapeDtypeStruct

  @property
  def abstract(self) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(self.args))


def abstractify(tree):
  """Array leaves as `jax.ShapeDtypeStruct`s; other leaves (a Python step count) unchanged."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if is_array(x) else x, tree)


def parameter_count(params) -> int:
  """Elements of a parameter tree, or of the parameters of a Flax `TrainState`."""
  leaves = jax.tree_util.tree_leaves(getattr(params, "params", params))
  return int(sum(np.prod(x.shape) for x in leaves if hasattr(x, "shape")))


def from_object(name: str, obj: Any) -> Workload:
  if isinstance(obj, Workload):
    return obj
  if isinstance(obj, tuple) and len(obj) == 2 and callable(obj[0]):
    fn, args = obj
    return Workload(name, fn, tuple(args) if isinstance(args, (tuple, list)) else (args,))
  raise WorkloadError(f"{name} must return (fn, example_args) or a Workload, got "
                      f"{type(obj).__name__}")


def load_user(spec: str) -> Workload:
  """`package.module:function` or `path/to/file.py:function`, called with no arguments."""
  target, _, func = spec.rpartition(":")
  if not target or not func:
    raise WorkloadError(f"bad model {spec!r}: use a corpus name (gpt:small), module:function or "
                        "path.py:function")
  if target.endswith(".py"):
    path = Path(target)
    if not path.is_file():
      raise WorkloadError(f"no such file {target!r}")
    mod_name = f"_shardzero_user_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
      module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report, do not crash
      raise WorkloadError(f"importing {target} failed: {type(e).__name__}: {e}") from None
  else:
    try:
      module = importlib.import_module(target)
    except ModuleNotFoundError as e:
      raise WorkloadError(f"no module {target!r} ({e})") from None
  fn = getattr(module, func, None)
  if fn is None or not callable(fn):
    raise WorkloadError(f"{target} has no function {func!r}")
  try:
    made = fn()
  except Exception as e:  # the user's code: one line, not a traceback
    raise WorkloadError(f"{spec} failed: {type(e).__name__}: {e}") from None
  return from_object(spec, made)


def replace_config(config, overrides: dict[str, str], family: str):
  """A frozen config with knobs set from strings, checked against its fields."""
  fields = {f.name: f for f in dataclasses.fields(config)}
  changes = {}
  for key, text in overrides.items():
    if key not in fields:
      raise WorkloadError(f"{family} has no knob {key!r}; knobs: {', '.join(fields)}")
    kind = type(getattr(config, key))
    if kind is bool:
      if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise WorkloadError(f"{family}: knob {key} wants true or false, got {text!r}")
      changes[key] = text.lower() in ("true", "1", "yes")
      continue
    try:
      changes[key] = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
    except ValueError:
      raise WorkloadError(f"{family}: knob {key} wants {kind.__name__}, got {text!r}") from None
  return dataclasses.replace(config, **changes)

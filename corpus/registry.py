"""The model corpus by name: `gpt:small`, `gpt:layers=24,d_model=2048`, `mlp:small,width=512`."""

from __future__ import annotations

import importlib.util
import re
from typing import Callable, NamedTuple

import jax

from corpus import gpt, mlp
from corpus.workload import Workload, abstractify, load_user, parameter_count, replace_config
from partitioner.errors import WorkloadError

# Above this many parameters example arguments are abstract unless asked otherwise.
ABSTRACT_ABOVE = 50_000_000


class Family(NamedTuple):
  name: str
  make: Callable          # config -> (train_step, init)
  presets: dict
  default: str
  description: str


FAMILIES: dict[str, Family] = {
    "mlp": Family("mlp", mlp.make, mlp.PRESETS, "small", "multi-layer perceptron, MSE, Adam"),
    "gpt": Family("gpt", gpt.make, gpt.PRESETS, "small",
                  "GPT decoder: causal attention, pre-LN, tied embeddings, Adam + clipping"),
}


def parse(spec: str):
  """(family, config) of a corpus spec."""
  family_name, _, rest = spec.partition(":")
  family = FAMILIES.get(family_name)
  if family is None:
    raise WorkloadError(f"unknown model family {family_name!r}; corpus: {', '.join(FAMILIES)}")
  preset, overrides = family.default, {}
  for part in filter(None, (p.strip() for p in rest.split(","))):
    key, eq, val = part.partition("=")
    if eq:
      overrides[key.strip()] = val.strip()
    elif part in family.presets:
      preset = part
    else:
      raise WorkloadError(f"{family_name} has no preset {part!r}; presets: "
                          f"{', '.join(family.presets)} (or knobs like layers=4)")
  return family, replace_config(family.presets[preset], overrides, family_name)


def build(spec: str, abstract: bool | None = None) -> Workload:
  """The training step of a corpus entry with example arguments (abstract for large sizes)."""
  family, config = parse(spec)
  train_step, init = family.make(config)
  key = jax.random.PRNGKey(config.seed)
  shapes = jax.eval_shape(init, key)
  if abstract is None:
    abstract = parameter_count(shapes[0]) > ABSTRACT_ABOVE
  args = shapes if abstract else init(key)
  return Workload(spec, train_step, tuple(args))


def load(spec: str, abstract: bool | None = None) -> Workload:
  """A corpus name, or a user's `module:function` / `path.py:function`."""
  head = spec.partition(":")[0]
  if head in FAMILIES:
    return build(spec, abstract)
  if ":" not in spec:
    raise WorkloadError(f"unknown model {spec!r}; use a corpus name ({', '.join(FAMILIES)}) "
                        "or module:function / path.py:function")
  if re.fullmatch(r"[A-Za-z_]\w*", head) and importlib.util.find_spec(head) is None:
    raise WorkloadError(f"unknown model {spec!r}: {head!r} is neither a corpus family "
                        f"({', '.join(FAMILIES)}) nor an importable module")
  workload = load_user(spec)
  return workload._replace(args=abstractify(workload.args)) if abstract else workload

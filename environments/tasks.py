"""Partitioning tasks: a workload, a mesh, a hardware and a memory budget per device.

A task distribution draws tasks from a corpus split with meshes of several shapes; its memory
budgets are fractions of what pure data parallelism needs, so that some tasks force the agent
to shard state and others do not.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import numpy as np

from partitioner.errors import ShardzeroError, WorkloadError

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str | int | float) -> int:
  """`"16GiB"`, `"512MiB"`, `"2e9"` or a number of bytes."""
  if isinstance(text, (int, float)):
    value = text
  else:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
      raise WorkloadError(f"bad memory size {text!r}; use bytes or a unit like 16GiB, 512MiB")
    try:
      value = float(m.group(1)) * unit
    except ValueError:
      raise WorkloadError(f"bad memory size {text!r}; use bytes or a unit like 16GiB") from None
  if value <= 0:
    raise WorkloadError(f"a memory budget must be positive, got {text!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Task:
  """What to partition and for what: `memory_budget` is bytes per device (None: the device's
  memory)."""
  model: str
  mesh: str = "batch=4,model=2"
  hardware: str = "h100"
  memory_budget: int | None = None

  def __str__(self) -> str:
    budget = "" if self.memory_budget is None else f", budget {self.memory_budget / 2**30:.3g} GiB"
    return f"{self.model} on {self.mesh} ({self.hardware}{budget})"


@functools.lru_cache(maxsize=32)
def load_program(model: str):
  """The traced training step of a model (abstract arguments), shared by all its tasks."""
  import corpus
  from partitioner import trace
  workload = corpus.load(model, abstract=True)
  return trace(workload.fn, *workload.args)


@functools.lru_cache(maxsize=256)
def data_parallel_peak(task: Task) -> int:
  """Peak bytes per device of pure data parallelism over every axis that divides the batch
  (the unpartitioned program's when none does)."""
  from partitioner import apply
  from partitioner.cost import simulate
  from partitioner.mesh import Mesh
  program, mesh = load_program(task.model), Mesh.parse(task.mesh)
  pp = apply(program, mesh)
  for axis in mesh.names:
    try:
      pp = pp.apply(f"BatchParallel({axis})")
    except ShardzeroError:
      pass
  return simulate(pp, task.hardware).peak_memory_bytes


@dataclasses.dataclass(frozen=True)
class TaskDistribution:
  """Tasks drawn uniformly: a model, a mesh, a hardware, and a budget that is a fraction of
  the data-parallel peak memory (None: the device's memory)."""
  models: tuple[str, ...]
  meshes: tuple[str, ...] = ("batch=8", "batch=4,model=2", "batch=2,model=4")
  hardware: tuple[str, ...] = ("h100",)
  budget_fractions: tuple[float | None, ...] = (None, 0.5)

  def __post_init__(self):
    if not self.models or not self.meshes or not self.hardware or not self.budget_fractions:
      raise WorkloadError("a task distribution needs models, meshes, hardware and budgets")
    for f in self.budget_fractions:
      if f is not None and not 0 < f:
        raise WorkloadError(f"budget fractions must be positive, got {f}")

  @classmethod
  def from_split(cls, split: str, preset: str = "small", **kwargs) -> "TaskDistribution":
    """The families of a corpus split ("train" or "heldout") at one preset."""
    import corpus
    return cls(tuple(f"{name}:{preset}" for name in corpus.split(split)), **kwargs)

  def sample(self, rng: np.random.Generator) -> Task:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    task = Task(pick(self.models), pick(self.meshes), pick(self.hardware))
    fraction = pick(self.budget_fractions)
    if fraction is None:
      return task
    return dataclasses.replace(task, memory_budget=max(1, int(fraction * data_parallel_peak(task))))

  def tasks(self) -> Sequence[Task]:
    """Every (model, mesh, hardware) with the device's memory as budget."""
    return [Task(m, mesh, hw) for m in self.models for mesh in self.meshes for hw in self.hardware]

"""Partitioning tasks: a workload, a mesh, a hardware and a memory budget per device.

A task distribution draws tasks from a corpus split with meshes of several shapes. A tight
memory budget lies between the smallest peak an expert strategy of the family reaches and what
pure data parallelism needs, so that the agent must shard state and a known strategy fits (half
of the data-parallel peak does not fit any strategy of most small models, whose activations
dominate: such tasks teach nothing but penalties).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from environments.caching import LRU
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


def _trace(model: str):
  """The traced training step of a model (abstract arguments)."""
  import corpus
  from partitioner import trace
  workload = corpus.load(model, abstract=True)
  return trace(workload.fn, *workload.args)


# Largest relative error of a folded step time or peak memory. 2%: since cost model 16 a
# layer's gradient reductions under sequence parallelism queue before the collectives the
# layer awaits, and the folded layer's (one for 22) queue longer than the deep program's
# (gpt:350m's dp+sp folded 0.9-1.5% slow at 8-256 H100s; every other expert of the training
# recipe's folded tasks within 0.25%).
FOLD_TOLERANCE = 0.02


def _fold(task: Task):
  """A `partitioner.folding.Folding` for a task whose corpus model is deeper than three
  layers: its traces at two and three layers. None for other models, for stacks that do not
  fold, when the folded program has other actions, and when the folded step time or peak
  memory of one of the family's expert strategies is off by more than FOLD_TOLERANCE."""
  import corpus
  family, _, rest = task.model.partition(":")
  depth = getattr(corpus.parse(task.model)[1], "layers", 0) if family in corpus.FAMILIES else 0
  if depth <= 3:
    return None
  from corpus.experts import simulate_experts
  from environments.actions import action_space, decision_points
  from partitioner.cost import Simulator, load_hardware
  from partitioner.folding import fold
  from partitioner.mesh import Mesh
  folding = fold(load_program(f"{family}:{rest},layers=2"),
                 load_program(f"{family}:{rest},layers=3"), depth)
  if folding is None:
    return None
  mesh, whole = Mesh.parse(task.mesh), load_program(task.model)
  names = lambda p: [str(a) for a in action_space(p, mesh, decision_points(p))]
  if names(folding.program) != names(whole):
    return None
  # The check is of the folding, so collectives are not combined here (buckets that cross
  # layers are only estimated on a folded program: within about 2% of the deep program's step
  # time on the GPT, T5 and SSM experts at 64 to 1024 devices), and kernels cost no launches
  # (where the launches of kernels fusing a folded layer's ops with its neighbours' fall beside
  # the collectives is estimated too: within 5%, tests/partitioner/test_folding.py).
  hardware = load_hardware(task.hardware).combining(0).launching(0.0)
  try:
    folded = simulate_experts(folding.program, mesh, hardware, family,
                              simulate=Simulator(folding.program, mesh, hardware, folding=folding))
    exact = simulate_experts(whole, mesh, hardware, family)
  except ShardzeroError:   # nothing to check the folding against
    return None
  for f, e in zip(folded, exact):
    if f.cost is None or e.cost is None:
      continue
    if (abs(f.cost.step_time_s / e.cost.step_time_s - 1) > FOLD_TOLERANCE or
        abs(f.cost.peak_memory_bytes / e.cost.peak_memory_bytes - 1) > FOLD_TOLERANCE):
      return None
  return folding


def _data_parallel_peak(task: Task) -> int:
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


def _smallest_expert_peak(task: Task) -> int | None:
  """The lowest peak bytes per device among the family's expert strategies (the generic ones
  for a program of no corpus family); None where none applies."""
  from corpus.experts import simulate_experts
  from corpus.registry import family_of
  results = simulate_experts(load_program(task.model), task.mesh, task.hardware,
                             family_of(task.model))
  return min((r.cost.peak_memory_bytes for r in results if r.cost is not None), default=None)


class TaskCache:
  """What the tasks of a process share, each kept for the most recently used: traced programs
  (by model), foldings (by task), the peaks tight budgets are made from, and task contexts
  (their cached states, by task, padding and folding)."""

  def __init__(self, programs: int = 32, peaks: int = 256, contexts: int = 64):
    self.programs = LRU(programs)
    self.foldings = LRU(programs)
    self.peaks = LRU(peaks)
    self.contexts = LRU(contexts)

  def program(self, model: str):
    return self.programs.get_or_make(model, lambda: _trace(model))

  def folding(self, task: Task):
    return self.foldings.get_or_make(task, lambda: _fold(task))

  def data_parallel_peak(self, task: Task) -> int:
    return self.peaks.get_or_make(("data", task), lambda: _data_parallel_peak(task))

  def smallest_expert_peak(self, task: Task) -> int | None:
    return self.peaks.get_or_make(("expert", task), lambda: _smallest_expert_peak(task))

  def clear(self) -> None:
    for cache in (self.programs, self.foldings, self.peaks, self.contexts):
      cache.clear()


# The process's task cache: enough for every task of a training distribution (an actor that
# rebuilt its contexts would lose the states its searches revisit).
TASKS = TaskCache()


def load_program(model: str):
  """The traced training step of a model (abstract arguments), shared by all its tasks."""
  return TASKS.program(model)


def folded_program(task: Task):
  """`TASKS.folding(task)`: see `_fold`."""
  return TASKS.folding(task)


def data_parallel_peak(task: Task) -> int:
  return TASKS.data_parallel_peak(task)


def smallest_expert_peak(task: Task) -> int | None:
  return TASKS.smallest_expert_peak(task)


def tight_budget(task: Task, fraction: float) -> int:
  """`fraction` of the way from the smallest expert peak (0) to the data-parallel peak (1);
  of the data-parallel peak alone where no expert strategy is known. A fraction below 0 (down
  to -1) goes from the smallest expert peak toward nothing: no plan of the whole batch fits,
  and the answer is one whose batch is cut into micro-batches."""
  high, low = data_parallel_peak(task), smallest_expert_peak(task)
  if low is None or low >= high:
    return max(1, int((fraction if fraction > 0 else 1 + fraction) * high))
  if fraction < 0:
    return max(1, int((1 + fraction) * low))
  return max(1, int(low + fraction * (high - low)))


def weak_scaled(model: str, mesh: str, batch_per_device: int | None) -> str:
  """`model` with a batch of `batch_per_device` examples per device of `mesh` (weak scaling:
  the work per device stays the same from mesh to mesh); unchanged without one. The appended
  knob overrides any batch the spec names."""
  if not batch_per_device:
    return model
  from partitioner.mesh import Mesh
  batch = int(batch_per_device) * Mesh.parse(mesh).device_count
  return model + ("," if ":" in model else ":") + f"batch={batch}"


@dataclasses.dataclass(frozen=True)
class TaskDistribution:
  """Tasks drawn uniformly: a model, a mesh, a hardware, and a budget (None: the device's
  memory; a fraction: `tight_budget`, between the smallest expert peak and the data-parallel
  peak). With `batch_per_device` (one count, or several drawn from like the rest), each
  model's batch is that many examples per device of the mesh it is drawn with (weak scaling,
  as users grow a run), whatever batch its spec names. One example per device is its own
  regime: cutting such a batch into micro-batches leaves some devices without an example of
  their own, where at two a cut into two keeps every device busy."""
  models: tuple[str, ...]
  meshes: tuple[str, ...] = ("batch=8", "batch=4,model=2", "batch=2,model=4")
  hardware: tuple[str, ...] = ("h100",)
  budget_fractions: tuple[float | None, ...] = (None, 0.5)
  batch_per_device: int | tuple[int, ...] | None = None

  def __post_init__(self):
    if not self.models or not self.meshes or not self.hardware or not self.budget_fractions:
      raise WorkloadError("a task distribution needs models, meshes, hardware and budgets")
    for f in self.budget_fractions:
      if f is not None and not -1 < f != 0:
        raise WorkloadError(f"budget fractions are above -1 and not 0, got {f}")
    if not self.batches or any(b is not None and b < 1 for b in self.batches):
      raise WorkloadError(f"batch_per_device must be positive, got {self.batch_per_device}")

  @property
  def batches(self) -> tuple:
    """The examples per device drawn from (None: each spec's own batch)."""
    b = self.batch_per_device
    return tuple(b) if isinstance(b, (tuple, list)) else (b,)

  @classmethod
  def from_split(cls, split: str, preset: str = "small", **kwargs) -> "TaskDistribution":
    """The families of a corpus split ("train" or "heldout") at one preset."""
    import corpus
    return cls(tuple(f"{name}:{preset}" for name in corpus.split(split)), **kwargs)

  def task(self, model: str, mesh: str, hardware: str, batch_per_device=None) -> Task:
    """The task of `model` on `mesh` at `batch_per_device` (default: the first drawn from)."""
    per_device = self.batches[0] if batch_per_device is None else batch_per_device
    return Task(weak_scaled(model, mesh, per_device), mesh, hardware)

  def sample(self, rng: np.random.Generator) -> Task:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    model, mesh, hardware = pick(self.models), pick(self.meshes), pick(self.hardware)
    # A single count draws nothing, so that runs from before several were possible draw alike.
    batches = self.batches
    task = self.task(model, mesh, hardware, pick(batches) if len(batches) > 1 else batches[0])
    fraction = pick(self.budget_fractions)
    if fraction is None:
      return task
    return dataclasses.replace(task, memory_budget=tight_budget(task, fraction))

  def tasks(self) -> Sequence[Task]:
    """Every (model, mesh, hardware, budget) the distribution draws from."""
    out = []
    for task in (self.task(m, mesh, hw, b) for m in self.models for mesh in self.meshes
                 for hw in self.hardware for b in self.batches):
      out += [task if f is None else dataclasses.replace(task, memory_budget=tight_budget(task, f))
              for f in self.budget_fractions]
    return out

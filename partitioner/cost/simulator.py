"""The simulator: predicted step time and memory of a partitioned program on given hardware.

A collective's exposed time is the compute idle time it causes; the rest overlaps with compute.
Hardware without async collectives (the host CPU) runs them in line.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import numpy as np

from partitioner.cost.communication import CollectiveTime, collective_time
from partitioner.cost.compute import _EFF, Divisors, ProgramWork
from partitioner.cost.hardware import Hardware, load_hardware
from partitioner.cost.memory import MemoryReport, ProgramLiveness, memory
from partitioner.cost.topology import Placement


class CollectiveCost(NamedTuple):
  kind: str
  axes: tuple[str, ...]
  bytes: int
  seconds: float
  exposed_seconds: float
  decomposition: str
  value: int
  op: int


@dataclasses.dataclass(frozen=True)
class CostReport:
  hardware: str
  step_time_s: float
  compute_s: float
  comm_s: float             # all collective time
  exposed_comm_s: float     # the part compute waited for
  flops: float              # per device
  hbm_bytes: float          # per device, at fused-kernel boundaries
  memory: MemoryReport
  placement: dict           # mesh axis -> "intra", "inter" or "both"
  # The plan's collectives, their times and exposed seconds; `collectives` pairs them up when
  # read (a search reads the totals only).
  timed_collectives: tuple = dataclasses.field(default=((), (), ()), repr=False)

  @functools.cached_property
  def collectives(self) -> list[CollectiveCost]:
    return [CollectiveCost(c.kind, c.axes, c.bytes, t.seconds, e, t.decomposition, c.value, c.op)
            for c, t, e in zip(*self.timed_collectives)]

  @property
  def fits(self) -> bool:
    return self.memory.fits

  @property
  def peak_memory_bytes(self) -> int:
    return self.memory.peak_bytes

  def decompositions(self) -> list[dict]:
    """Per (kind, axes): how each collective is run across the link levels, and its time."""
    groups: dict = {}
    for c in self.collectives:
      g = groups.setdefault((c.kind, c.axes, c.decomposition), {
          "kind": c.kind, "axes": list(c.axes), "decomposition": c.decomposition, "count": 0,
          "bytes": 0, "seconds": 0.0, "exposed_seconds": 0.0})
      g["count"] += 1
      g["bytes"] += c.bytes
      g["seconds"] += c.seconds
      g["exposed_seconds"] += c.exposed_seconds
    return sorted(groups.values(), key=lambda g: -g["seconds"])

  def to_dict(self) -> dict:
    return {"hardware": self.hardware, "step_time_s": self.step_time_s,
            "compute_s": self.compute_s, "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s, "flops": self.flops,
            "hbm_bytes": self.hbm_bytes, "peak_memory_bytes": self.peak_memory_bytes,
            "fits": self.fits, "memory": self.memory._asdict(), "placement": self.placement,
            "decompositions": self.decompositions()}


class _Derived(NamedTuple):
  """What one simulator computed for one partitioned program, kept for its children."""
  divisors: np.ndarray                    # per value: into how many pieces it is cut


class _PlanArrays(NamedTuple):
  """The plan's copies, their readers, out-of-place results and collectives, as arrays."""
  copy_value: np.ndarray      # per resharded copy
  copy_pieces: np.ndarray
  copy_issue: np.ndarray      # the op before which it is made
  copy_last: np.ndarray       # its last reader
  read_op: np.ndarray         # per (op, operand) read through a copy
  read_copy: np.ndarray
  staged_op: np.ndarray       # per result resharded out of place
  staged_value: np.ndarray
  staged_pieces: np.ndarray
  value: np.ndarray           # per collective
  op: np.ndarray
  copy: np.ndarray


def _ints(xs) -> np.ndarray:
  return np.array(xs, np.int64).reshape(-1)


_NEVER = np.iinfo(np.int64).max


class Simulator:
  """Simulates the partitioned versions of one program on one hardware and device layout.

  What does not depend on the sharding is computed once; op costs are computed with arrays,
  and a program derived by one more tactic (`pp.parent`) updates its parent's per-value
  layouts and plan rather than recomputing them; the schedule and the memory profile are
  array passes over the plan (a changed collective moves every later time). Compute runs fused
  kernels in program order; collectives run in the order they become ready on one network
  stream (async, as XLA's latency-hiding scheduler issues them) and a kernel that needs a
  collective's result waits for it. A resharded operand copy is prefetched while the previous
  copy's first reader runs (as FSDP prefetches the next layer) and lives from then to its last
  reader.

  `folding` (partitioner.folding) makes `program` stand for a deeper one: op times and
  collectives count as many times as the ops they stand for, buffers as many as they stand for.
  Likewise the body of a loop runs (and communicates) once per iteration; its buffers exist
  once at a time.
  """

  def __init__(self, program, mesh, hardware: Hardware | str, order: Sequence[str] | None = None,
               donate: bool = True, folding=None):
    if folding is not None and folding.program is not program:
      raise ValueError("the folding is of another program")
    self.program = program
    self.folding = folding
    weight = program.op_repeat if program.regions else None
    if folding is not None:
      weight = folding.op_weight if weight is None else weight * folding.op_weight
    self.op_weight = weight      # per op: how many times a step runs it (None: once)
    self.hardware = hw = load_hardware(hardware)
    self.placement = Placement(mesh, self.hardware, order)
    self.work = work = ProgramWork.of(program)
    self.liveness = ProgramLiveness(program, work, donate, folding)
    self.divisors = Divisors(program, mesh.sizes)
    self.rate = np.array([hw.flops(w.dtype) * hw.efficiency[_EFF[w.kind]] for w in work.work])
    # Per value: the first place in the run order where an op reads it.
    self.first_read = np.full(len(program.values), _NEVER, np.int64)
    for v, readers in enumerate(program.users):
      if readers:
        self.first_read[v] = min(int(work.group[u]) for u in readers)
    self._collective_cache: dict = {}

  def collective(self, kind, nbytes, axes):
    key = (kind, nbytes, axes)
    out = self._collective_cache.get(key)
    if out is None:
      out = self._collective_cache[key] = collective_time(kind, nbytes,
                                                          self.placement.group(axes),
                                                          self.hardware)
    return out

  def times(self, collectives) -> list[CollectiveTime]:
    """Time and decomposition of each collective, looked up in bulk."""
    keys = [(c.kind, c.bytes, c.axes) for c in collectives]
    out = list(map(self._collective_cache.get, keys))
    if None in out:
      out = [t or self.collective(*key) for t, key in zip(out, keys)]
    return out

  def arrays(self, plan) -> _PlanArrays:
    """The plan as arrays, so that costs, schedule and memory are numpy passes over it."""
    pieces, producer = self.divisors.of, self.work.producer
    value, dims, first, last = zip(*plan.copies) if plan.copies else ((),) * 4
    value, first = _ints(value), _ints(first)
    # A copy is made once its value exists and the previous copy is being read.
    issue = np.maximum(producer[value] + 1, np.concatenate([[0], first[:-1]]))
    reads = _ints(list(plan.copy_of)).reshape(-1, 2)[:, 0]
    staged = tuple(zip(*plan.staged)) if plan.staged else ((),) * 3
    coll = tuple(zip(*plan.collectives)) if plan.collectives else ((),) * 7
    return _PlanArrays(value, _ints([pieces(d) for d in dims]), issue, _ints(last), reads,
                       _ints(list(plan.copy_of.values())), _ints(staged[0]), _ints(staged[1]),
                       _ints([pieces(d) for d in staged[2]]), _ints(coll[3]), _ints(coll[4]),
                       _ints(coll[6]))

  def costs(self, pp, arrays: _PlanArrays | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Per value: pieces; per op: local FLOPs and local HBM bytes at fused-kernel boundaries.

    Every op is first costed as if it read and wrote its values as laid out; ops that reshard
    are then corrected from their plan: operands read through a resharded copy, results made
    in another layout, and work split over partial (reduced) axes."""
    work, plan, dims, program = self.work, pp.plan, pp.state.dims, self.program
    a = arrays if arrays is not None else self.arrays(plan)
    parent = pp.parent
    base = parent.derived.get(self) if parent is not None else None
    if base is None:
      divisors = self.divisors.values(dims)
    else:
      divisors = self.divisors.values(dims, base.divisors, pp.state.changed)
    n = len(program.ops)
    shard = np.where(work.work_value >= 0, divisors[work.work_value], 1.0)
    local = work.value_bytes / divisors
    scale = work.read_scale
    nbytes = (np.bincount(work.read_op, local[work.read_value] * scale[work.read_op],
                          minlength=n) +
              np.bincount(work.write_op, local[work.write_value], minlength=n))
    v = a.copy_value[a.read_copy]
    nbytes += np.bincount(a.read_op, np.where(work.internal[v], 0.0, work.value_bytes[v] /
                                              a.copy_pieces[a.read_copy] - local[v]) *
                          scale[a.read_op], minlength=n)
    plan_ops, tensor = plan.ops, work.work_tensor
    communicating = _ints(plan.communicating)
    for i in communicating[work.global_flops[communicating] > 0].tolist():
      t = tensor[i]
      shard[i] = plan_ops[i].split if t < 0 else plan_ops[i].pieces[t]
    pp.derived[self] = _Derived(divisors)
    return divisors, work.global_flops / shard, nbytes

  def __call__(self, pp) -> CostReport:
    hw, work = self.hardware, self.work
    a = self.arrays(pp.plan)
    divisors, flops, nbytes = self.costs(pp, a)
    timed = self.times(pp.collectives)
    durations = [t.seconds for t in timed]
    if self.op_weight is not None:
      weight = self.op_weight
      flops, nbytes = flops * weight, nbytes * weight
      durations = (np.array(durations) * weight[a.op]).tolist()
    compute = np.bincount(work.group, flops / self.rate, minlength=work.groups)
    memory_s = np.bincount(work.group, nbytes, minlength=work.groups) / (
        hw.hbm_bandwidth * hw.efficiency["memory"])
    kernels = np.maximum(compute, memory_s)
    exposed = self._schedule(a, durations, kernels)
    compute_s = float(kernels.sum())
    mem = memory(self.liveness, divisors, (a.copy_value, a.copy_pieces, a.copy_issue, a.copy_last),
                 (a.staged_op, a.staged_value, a.staged_pieces), hw.hbm_bytes)
    return CostReport(hw.name, compute_s + float(sum(exposed)), compute_s, float(sum(durations)),
                      float(sum(exposed)), float(flops.sum()), float(nbytes.sum()), mem,
                      self.placement.describe(), (pp.collectives, timed, exposed))

  def _schedule(self, a: _PlanArrays, durations, kernels) -> list[float]:
    """Per collective, the compute idle time spent while it ran.

    Kernels run in a fixed order (ProgramWork.order); the time at place p is the sum of the
    kernels before it plus the waits so far, so only the places where a collective is issued or
    first awaited are visited (once a kernel has waited for a collective, later readers find it
    done)."""
    n = len(durations)
    exposed = [0.0] * n
    if not n:
      return exposed
    if not self.hardware.overlap_collectives:  # run in line
      return list(durations)
    at, producer = self.work.group, self.work.producer
    copy = np.maximum(a.copy, 0)
    made = at[producer[a.value]] + 1
    made[producer[a.value] < 0] = 0
    first_wait = np.full(len(a.copy_value) + 1, _NEVER, np.int64)
    np.minimum.at(first_wait, a.read_copy, at[a.read_op])
    if len(a.copy_value):
      made = np.maximum(made, at[a.copy_issue[copy]])
    ready = np.where(a.copy >= 0, made, at[a.op] + 1)
    waits = np.maximum(np.where(a.copy >= 0, first_wait[copy], self.first_read[a.value]), ready)
    awaited = np.nonzero(waits < _NEVER)[0]
    places = np.concatenate([ready, waits[awaited]])
    what = np.concatenate([np.zeros(n, np.int64), np.ones(len(awaited), np.int64)])
    which = np.concatenate([np.arange(n), awaited])
    order = np.lexsort((which, what, places))
    before = np.concatenate([[0.0], np.cumsum(kernels)]).tolist()  # compute before place p
    offset = network = 0.0
    done = [0.0] * n
    issued, rank = [], [0] * n

    def wait(k, now):
      """The network is busy from now until k is done: charge the wait to the collectives that
      run in that time (k and those queued before it)."""
      j = rank[k]
      while j >= 0 and done[issued[j]] > now:
        q = issued[j]
        exposed[q] += min(done[q], done[k]) - max(done[q] - durations[q], now)
        j -= 1
      return done[k] - now

    for position, awaits, k in zip(places[order].tolist(), what[order].tolist(),
                                   which[order].tolist()):
      now = before[position] + offset
      if not awaits:
        network = done[k] = max(network, now) + durations[k]
        rank[k] = len(issued)
        issued.append(k)
      elif done[k] > now:
        offset += wait(k, now)
    end = before[-1] + offset
    if issued and done[issued[-1]] > end:   # collectives whose results only the outputs need
      wait(issued[-1], end)
    return exposed


@functools.lru_cache(maxsize=32)
def _simulator(program, mesh, hardware, order, donate) -> Simulator:
  return Simulator(program, mesh, hardware, order, donate)


def simulate(pp, hardware: Hardware | str = "h100", order: Sequence[str] | None = None,
             donate: bool = True) -> CostReport:
  """Predicted per-device step time, communication and memory of a partitioned program.

  `order`: mesh axes major to minor in device numbering (minor axes fill a node first).
  `donate`: updated state reuses its input's buffer (as with jit's donate_argnums)."""
  return _simulator(pp.program, pp.mesh, load_hardware(hardware),
                    tuple(order) if order else None, donate)(pp)

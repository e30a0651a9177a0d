"""The simulator: predicted step time and memory of a partitioned program on given hardware.

A collective's exposed time is the compute idle time it causes; the rest overlaps with compute.
Hardware without async collectives (the host CPU) runs them in line.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple, Sequence

import numpy as np

from partitioner.cost.communication import collective_time
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


class CostReport(NamedTuple):
  hardware: str
  step_time_s: float
  compute_s: float
  comm_s: float             # all collective time
  exposed_comm_s: float     # the part compute waited for
  flops: float              # per device
  hbm_bytes: float          # per device, at fused-kernel boundaries
  collectives: list[CollectiveCost]
  memory: MemoryReport
  placement: dict           # mesh axis -> "intra", "inter" or "both"

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


class Simulator:
  """Simulates the partitioned versions of one program on one hardware and device layout.

  What does not depend on the sharding is computed once; op costs are computed with arrays,
  and a program derived by one more tactic (`pp.parent`) updates its parent's per-value
  layouts and plan rather than recomputing them. Compute runs fused kernels in program order;
  collectives run in the order they become ready on one network stream (async, as XLA's
  latency-hiding scheduler issues them) and a kernel that needs a collective's result waits
  for it. A resharded operand copy is prefetched while the previous copy's first reader runs
  (as FSDP prefetches the next layer) and lives from then to its last reader.
  """

  def __init__(self, program, mesh, hardware: Hardware | str, order: Sequence[str] | None = None,
               donate: bool = True):
    self.program = program
    self.hardware = hw = load_hardware(hardware)
    self.placement = Placement(mesh, self.hardware, order)
    self.work = work = ProgramWork.of(program)
    self.liveness = ProgramLiveness(program, work, donate)
    self.divisors = Divisors(program, mesh.sizes)
    self.rate = np.array([hw.flops(w.dtype) * hw.efficiency[_EFF[w.kind]] for w in work.work])
    self._collective_cache: dict = {}

  def collective(self, kind, nbytes, axes):
    key = (kind, nbytes, axes)
    out = self._collective_cache.get(key)
    if out is None:
      out = self._collective_cache[key] = collective_time(kind, nbytes,
                                                          self.placement.group(axes),
                                                          self.hardware)
    return out

  def costs(self, pp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per value: pieces; per op: local FLOPs and local HBM bytes at fused-kernel boundaries.

    Every op is first costed as if it read and wrote its values as laid out; ops that reshard
    are then corrected from their plan: operands read through a resharded copy, results made
    in another layout, and work split over partial (reduced) axes."""
    work, plan, dims, program = self.work, pp.plan, pp.state.dims, self.program
    parent = pp.parent
    base = parent.derived.get(self) if parent is not None else None
    if base is None:
      divisors = self.divisors.values(dims)
    else:
      divisors = self.divisors.values(dims, base.divisors, pp.state.changed)
    n = len(program.ops)
    shard = np.where(work.work_value >= 0, divisors[work.work_value], 1.0)
    local = work.value_bytes / divisors
    nbytes = (np.bincount(work.read_op, local[work.read_value], minlength=n) +
              np.bincount(work.write_op, local[work.write_value], minlength=n))
    pieces, count, internal = self.divisors.of, self.divisors.count, work.internal
    for (i, k), c in plan.copy_of.items():
      v = program.ops[i].inputs[k]
      if not internal[v]:
        nbytes[i] += work.value_bytes[v] / pieces(plan.ops[i].operand_dims[k]) - local[v]
    for i in plan.communicating:
      w = work.work[i]
      if w.flops:
        op, op_plan = program.ops[i], plan.ops[i]
        t = w.work_tensor
        if t < 0:
          res = op_plan.result[0]
          shard[i] = pieces(res.dims) * (count(res.partial) if res.partial else 1)
        elif t < len(op.inputs):
          shard[i] = pieces(op_plan.operand_dims[t])
        else:
          shard[i] = pieces(op_plan.result[t - len(op.inputs)].dims)
    pp.derived[self] = _Derived(divisors)
    return divisors, work.global_flops / shard, nbytes

  def __call__(self, pp) -> CostReport:
    hw, work = self.hardware, self.work
    divisors, flops, nbytes = self.costs(pp)
    compute = np.bincount(work.group, flops / self.rate, minlength=work.groups)
    memory_s = np.bincount(work.group, nbytes, minlength=work.groups) / (
        hw.hbm_bandwidth * hw.efficiency["memory"])
    kernels = np.maximum(compute, memory_s)
    timed = [self.collective(c.kind, c.bytes, c.axes) for c in pp.collectives]
    durations = [t.seconds for t in timed]
    issue = self._copy_issue(pp)
    exposed = self._schedule(pp, durations, kernels, issue)
    compute_s = float(kernels.sum())
    costs = [CollectiveCost(c.kind, c.axes, c.bytes, t.seconds, e, t.decomposition, c.value, c.op)
             for c, t, e in zip(pp.collectives, timed, exposed)]
    mem = memory(pp, self.liveness, divisors, self.divisors.of, issue, hw.hbm_bytes)
    return CostReport(hw.name, compute_s + float(sum(exposed)), compute_s, float(sum(durations)),
                      float(sum(exposed)), float(flops.sum()), float(nbytes.sum()), costs, mem,
                      self.placement.describe())

  def _copy_issue(self, pp) -> list[int]:
    """Per resharded copy, the op before which it is made: once its value exists and the
    previous copy is being read."""
    producer, out, previous = self.work.producer, [], 0
    for c in pp.plan.copies:
      out.append(max(int(producer[c.value]) + 1, previous))
      previous = c.first
    return out

  def _schedule(self, pp, durations, kernels, issue) -> list[float]:
    """Per collective, the compute idle time spent while it ran.

    Kernels run in a fixed order (ProgramWork.order); the time at place p is the sum of the
    kernels before it plus the waits so far, so only the places where a collective is issued or
    awaited are visited."""
    exposed = [0.0] * len(durations)
    if not durations:
      return exposed
    if not self.hardware.overlap_collectives:  # run in line
      return list(durations)
    users, producer = self.program.users, self.work.producer
    at = self.work.group                           # per op: its kernel's place in the run order
    before = np.concatenate([[0.0], np.cumsum(kernels)]).tolist()  # compute before place p
    events = []                  # (place, 0: issue / 1: await, collective)
    readers = collections.defaultdict(list)
    for (op, _), c in pp.plan.copy_of.items():
      readers[c].append(op)
    for k, c in enumerate(pp.collectives):
      if c.copy >= 0:
        p = producer[c.value]
        ready = max(0 if p < 0 else int(at[p]) + 1, int(at[issue[c.copy]]))
        waiters = readers[c.copy]
      else:                      # a result being reduced or resharded
        ready = int(at[c.op]) + 1
        waiters = users[c.value]
      events.append((ready, 0, k))
      for op in waiters:         # a reader fused with the producer waits after it
        events.append((max(int(at[op]), ready), 1, k))
    events.sort()
    offset = network = 0.0
    done = [0.0] * len(durations)
    issued, rank = [], [0] * len(durations)

    def wait(k, now):
      """The network is busy from now until k is done: charge the wait to the collectives that
      run in that time (k and those queued before it)."""
      j = rank[k]
      while j >= 0 and done[issued[j]] > now:
        q = issued[j]
        exposed[q] += min(done[q], done[k]) - max(done[q] - durations[q], now)
        j -= 1
      return done[k] - now

    for position, what, k in events:
      now = before[position] + offset
      if what == 0:
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

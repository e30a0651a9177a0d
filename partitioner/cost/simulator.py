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
from partitioner.cost.compute import _EFF, BARRIER, Divisors, ProgramWork
from partitioner.cost.hardware import Hardware, load_hardware
from partitioner.cost.memory import MemoryReport, ProgramLiveness, memory
from partitioner.cost.topology import Placement
from partitioner.ir import per_program

COMBINED_KINDS = ("all-reduce", "all-gather", "reduce-scatter")   # XLA has a combiner for each


class CollectiveCost(NamedTuple):
  kind: str
  axes: tuple[str, ...]
  bytes: int
  seconds: float
  exposed_seconds: float
  decomposition: str
  value: int
  op: int
  combined: float = 1.0     # tensors per combined collective it runs in (1: alone)
  repeat: float = 1.0       # how many times a step runs it (a loop's body, a folded layer)


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
  # The plan's collectives, their times (per occurrence), exposed seconds (per step), combined
  # buckets and repeats; `collectives` pairs them up when read (a search reads the totals only).
  timed_collectives: tuple = dataclasses.field(default=((), (), (), None, None), repr=False)

  @functools.cached_property
  def collectives(self) -> list[CollectiveCost]:
    collectives, timed, exposed, buckets, repeats = self.timed_collectives
    repeats = [1.0] * len(collectives) if repeats is None else repeats
    if buckets is None:
      return [CollectiveCost(c.kind, c.axes, c.bytes, t.seconds, e, t.decomposition, c.value,
                             c.op, 1.0, r)
              for c, t, e, r in zip(collectives, timed, exposed, repeats)]
    seconds, launches, decompositions = buckets   # shares of the buckets they ran in
    return [CollectiveCost(c.kind, c.axes, c.bytes, t, e, d, c.value, c.op, 1.0 / l, r)
            for c, t, e, d, l, r in zip(collectives, seconds.tolist(), exposed, decompositions,
                                        launches.tolist(), repeats)]

  @property
  def fits(self) -> bool:
    return self.memory.fits

  @property
  def peak_memory_bytes(self) -> int:
    return self.memory.peak_bytes

  def decompositions(self) -> list[dict]:
    """Per (kind, axes): how each collective is run across the link levels, and its time;
    `count` tensors in `launches` collectives (fewer where the combiner joined them), `bytes`
    and `seconds` once each, and `step_*` as often as a step runs them (a loop's body runs
    every iteration), like `exposed_seconds`."""
    groups: dict = {}
    for c in self.collectives:
      g = groups.setdefault((c.kind, c.axes, c.decomposition), {
          "kind": c.kind, "axes": list(c.axes), "decomposition": c.decomposition, "count": 0,
          "launches": 0.0, "bytes": 0, "seconds": 0.0, "step_launches": 0.0, "step_bytes": 0.0,
          "step_seconds": 0.0, "exposed_seconds": 0.0})
      g["count"] += 1
      g["launches"] += 1.0 / c.combined
      g["bytes"] += c.bytes
      g["seconds"] += c.seconds
      g["step_launches"] += c.repeat / c.combined
      g["step_bytes"] += c.bytes * c.repeat
      g["step_seconds"] += c.seconds * c.repeat
      g["exposed_seconds"] += c.exposed_seconds
    return sorted(groups.values(), key=lambda g: -g["step_seconds"])

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


class _Buckets(NamedTuple):
  """Combined collectives: units (a collective, or one layer's copy of a folded one) and the
  buckets they run in."""
  member: np.ndarray      # per unit: the collective
  bucket: np.ndarray      # per unit: its bucket
  size: np.ndarray        # per bucket: bytes of one launch
  repeat: np.ndarray      # per bucket: launches per step (a loop's trips, a folded layer's)
  layer: np.ndarray       # per bucket of layers' copies: the layer of its last (-1: none)


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
    self.work = work = ProgramWork.of(program, hw.fusion)
    self.liveness = ProgramLiveness(program, work, donate, folding)
    self.divisors = Divisors(program, mesh.sizes)
    self.rate = np.array([hw.flops(w.dtype) * hw.efficiency[_EFF[w.kind]] for w in work.work])
    # Per fused kernel: its launches per step (a loop body's once per iteration, a folded
    # layer's once per layer it stands for; one fusing ops of several weights at a folded
    # layer's edge, its ops' mean weight: within a kernel of the deep program's count on a
    # six-layer GPT), each costing the hardware's launch overhead.
    launches = np.ones(work.groups)
    if weight is not None:
      launches = (np.bincount(work.group, weight, minlength=work.groups) /
                  np.maximum(np.bincount(work.group, minlength=work.groups), 1))
    kernel = np.array([op.name != BARRIER for op in program.ops], np.float64)
    launches[np.bincount(work.group, kernel, minlength=work.groups) == 0] = 0.0  # no kernel
    self.launch_s = hw.kernel_launch_s * launches
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
              np.bincount(work.write_op, local[work.write_value] * work.write_scale[work.write_op],
                          minlength=n))
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
    if pp.program is not self.program:   # e.g. a schedule ending Microbatch/Remat rewrote it
      raise ValueError("the plan is of another program than the simulator's (a schedule that "
                       "cuts the batch or recomputes rewrites the program): price it with a "
                       "Simulator of pp.program, or with simulate(pp)")
    hw, work = self.hardware, self.work
    a = self.arrays(pp.plan)
    divisors, flops, nbytes = self.costs(pp, a)
    collectives = pp.collectives
    timed = self.times(collectives)
    durations = np.array([t.seconds for t in timed])
    if self.op_weight is not None:
      weight = self.op_weight
      flops, nbytes = flops * weight, nbytes * weight
      durations = durations * weight[a.op]
    compute = np.bincount(work.group, flops / self.rate, minlength=work.groups)
    memory_s = np.bincount(work.group, nbytes, minlength=work.groups) / (
        hw.hbm_bandwidth * hw.efficiency["memory"])
    kernels = np.maximum(compute, memory_s) + self.launch_s
    ready, waits = self._places(a)
    buckets = (self._combine(collectives, a, ready, waits)
               if hw.combine_threshold_bytes and len(collectives) > 1 else None)
    if buckets is None:
      layers = None if self.folding is None else self.folding.op_weight[a.op]
      exposed = self._run(ready, waits, durations.tolist(), kernels, layers)
    else:
      durations, exposed, buckets = self._run_combined(collectives, buckets, a, ready, waits,
                                                       kernels)
    compute_s = float(kernels.sum())
    mem = memory(self.liveness, divisors, (a.copy_value, a.copy_pieces, a.copy_issue, a.copy_last),
                 (a.staged_op, a.staged_value, a.staged_pieces), hw.hbm_bytes)
    return CostReport(hw.name, compute_s + float(sum(exposed)), compute_s,
                      float(np.sum(durations)), float(sum(exposed)), float(flops.sum()),
                      float(nbytes.sum()), mem, self.placement.describe(),
                      (collectives, timed, exposed, buckets,
                       None if self.op_weight is None else self.op_weight[a.op].tolist()))

  def _places(self, a: _PlanArrays) -> tuple[np.ndarray, np.ndarray]:
    """Per collective: the place in the run order where it can be issued, and the place of the
    first kernel that waits for its result (_NEVER: only the outputs need it)."""
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
    return ready, waits

  def _combine(self, collectives, a: _PlanArrays, ready, waits) -> _Buckets | None:
    """Buckets of collectives run as one, as XLA's combiners form them: the same kind,
    reduction and devices, independent (each is issued before any of them is awaited), in the
    order they become ready, up to the hardware's threshold in bytes; a loop body's within an
    iteration, and run once per trip. A folded layer's collectives are packed within the layer
    and their buckets run once per layer it stands for, except those every layer makes before
    any is read (gradients reduced for the optimizer): those are packed once per layer, so
    they fill buckets across layers as in the deep program. None when nothing combines."""
    threshold = self.hardware.combine_threshold_bytes
    n = len(collectives)
    region = self.program.region_of[a.op].tolist() if self.program.regions else [-1] * n
    weight = self.op_weight[a.op].tolist() if self.op_weight is not None else [1.0] * n
    fold = self.folding.op_weight[a.op].tolist() if self.folding is not None else [1.0] * n
    spreads = self._read_after_block(ready, waits) if self.folding is not None else [False] * n
    waits_l, ready_l = waits.tolist(), ready.tolist()
    base = [(c.kind, c.reduce, c.axes, region[k]) if c.kind in COMBINED_KINDS else None
            for k, c in enumerate(collectives)]
    candidate = [b is not None and fold[k] > 1 and region[k] < 0 and spreads[k]
                 for k, b in enumerate(base)]
    # A collective of the layer awaited at once between them (a statistic of the backward
    # pass) closes the layer's bucket in the deep program: then its copies do not combine.
    span: dict = {}
    for k, b in enumerate(base):
      if candidate[k]:
        lo, hi = span.get(b, (ready_l[k], ready_l[k]))
        span[b] = min(lo, ready_l[k]), max(hi, ready_l[k])
    closed = {b for k, b in enumerate(base) if b in span and not candidate[k] and fold[k] > 1
              and span[b][0] <= ready_l[k] <= span[b][1]}
    keys: dict = {}
    key, layers = [-1] * n, [0] * n     # layers: copies packed one by one (0: none)
    for k, b in enumerate(base):
      if b is not None:
        layers[k] = int(fold[k]) if candidate[k] and b not in closed else 0
        key[k] = keys.setdefault((*b, 1.0 if layers[k] else weight[k]), len(keys))
    members: list[int] = []
    buckets: list[int] = []
    size: list[int] = []
    repeat: list[float] = []
    deadline: list[int] = []
    last_layer: list[int] = []
    open_ = [-1] * len(keys)
    runs: list[list[int]] = [[] for _ in keys]

    def place(k: int, g: int, layer: int = -1) -> None:
      b = open_[g] if g >= 0 else -1
      nbytes, times = collectives[k].bytes, 1.0 if layers[k] else weight[k]
      if b >= 0 and size[b] + nbytes <= threshold and ready_l[k] <= deadline[b]:
        size[b] += nbytes
        deadline[b] = min(deadline[b], waits_l[k])
        last_layer[b] = max(last_layer[b], layer)
      else:
        b = len(size)
        size.append(nbytes), deadline.append(waits_l[k]), repeat.append(times)
        last_layer.append(layer)
        if g >= 0:
          open_[g] = b
      members.append(k), buckets.append(b)

    def flush(g: int) -> None:
      run = runs[g]
      for layer in range(layers[run[0]] if run else 0):
        for k in run:
          place(k, g, layer)
      run.clear()

    # A folded block need not start where a layer does: members of the key that become ready
    # among its collectives are packed before its copies rather than splitting them.
    run_end = [-1] * len(keys)
    for k in range(n):
      if layers[k]:
        run_end[key[k]] = max(run_end[key[k]], ready_l[k])
    for k in np.lexsort((np.arange(n), ready)).tolist():
      g = key[k]
      if g >= 0 and layers[k]:
        runs[g].append(k)
        continue
      if g >= 0 and ready_l[k] > run_end[g]:
        flush(g)
      place(k, g)
    for g in range(len(keys)):
      flush(g)
    if len(size) == n and len(members) == n:
      return None
    return _Buckets(np.array(members), np.array(buckets), np.array(size, np.float64),
                    np.array(repeat), np.array(last_layer))

  @functools.cached_property
  def _unfolded_before(self) -> tuple[np.ndarray, np.ndarray, int]:
    """Per place in the run order: whether its kernel stands for several layers, and how many
    kernels before it stand for one; and a tenth of the kernels that stand for several (about
    a tenth of one layer's)."""
    least = np.ones(self.work.groups + 1)       # a kernel fusing ops of both kinds stands for one
    least[:-1] = np.inf
    np.minimum.at(least, self.work.group, self.folding.op_weight)
    folded = least > 1
    return folded, np.concatenate([[0], np.cumsum(~folded)]), max(1, int(folded.sum()) // 10)

  def _read_after_block(self, ready, waits) -> list[bool]:
    """Per collective: whether every layer's copy of it is made before any is read in the deep
    program, so that the copies combine with each other: nothing reads it, or a kernel of one
    layer does (a sum over the layers' gradient norms), or one of the folded layer's that runs
    after a stretch of one-layer kernels (the optimizer, after the first layer's backward
    pass; a stray op between two parts of the folded layer's does not count)."""
    folded, before, stretch = self._unfolded_before
    last = len(folded) - 1
    at = np.minimum(waits, last)
    return ((waits >= _NEVER) | ~folded[at] |
            (before[at] - before[np.minimum(ready, last)] >= stretch)).tolist()

  def _run_combined(self, collectives, buckets: _Buckets, a: _PlanArrays, ready, waits,
                    kernels):
    """The schedule of the buckets: alike buckets (the same collectives, as in each copy of a
    folded layer) run as one event of their summed time, at their collectives' places in this
    program. A collective's time and exposed time are its share, by bytes, of those of the
    buckets its copies run in. Returns (per event: seconds, per collective: exposed seconds,
    the per-collective figures for the report)."""
    member, bucket, size, repeat, last_layer = buckets
    m, n = len(size), len(collectives)
    order = np.lexsort((member, bucket))
    bounds = np.flatnonzero(np.diff(bucket[order])) + 1
    signature = {}
    event = np.empty(m, np.int64)
    for b, group in zip(bucket[order][np.concatenate([[0], bounds])].tolist(),
                        np.split(member[order], bounds)):
      event[b] = signature.setdefault(tuple(group.tolist()), len(signature))
    first = np.full(m, len(member), np.int64)
    np.minimum.at(first, bucket, np.arange(len(member)))
    lead = member[first]
    bucket_timed = [self.collective(collectives[k].kind, int(b), collectives[k].axes)
                    for k, b in zip(lead.tolist(), size.tolist())]
    one = np.array([t.seconds for t in bucket_timed]) * repeat   # per bucket, per step
    e = len(signature)
    durations = np.bincount(event, one, minlength=e)
    unit_event = event[bucket]
    e_ready = np.zeros(e, np.int64)
    np.maximum.at(e_ready, unit_event, ready[member])
    e_waits = np.full(e, _NEVER, np.int64)
    np.minimum.at(e_waits, unit_event, waits[member])
    layers = layer = None
    if self.folding is not None:
      # Per event: the layers' issues of it (a bucket of layers' copies: one), and the layer of
      # the last copy of an event of one such bucket (-1: none).
      fold = self.folding.op_weight[a.op[lead]]
      packed = last_layer >= 0
      layers = np.bincount(event, np.where(packed, 1.0, fold), minlength=e)
      layer = np.full(e, -1, np.int64)
      alone = (np.bincount(event, minlength=e) == 1)[event] & packed
      layer[event[alone]] = last_layer[alone]
    exposed_e = np.array(self._run(e_ready, np.maximum(e_waits, e_ready), durations.tolist(),
                                   kernels, layers, layer))
    nbytes = np.array([c.bytes for c in collectives], np.float64)
    share = nbytes[member] / size[bucket]
    seconds_u = one[bucket] * share
    exposed_u = exposed_e[unit_event] * np.divide(seconds_u, durations[unit_event],
                                                  out=np.zeros(len(member)),
                                                  where=durations[unit_event] > 0)
    exposed = np.bincount(member, exposed_u, minlength=n)
    weight = self.op_weight[a.op] if self.op_weight is not None else np.ones(n)
    tensors = np.bincount(bucket, minlength=m)
    seconds = np.bincount(member, seconds_u, minlength=n) / weight
    launches = np.bincount(member, repeat[bucket] / tensors[bucket], minlength=n) / weight
    report = (seconds, launches, [bucket_timed[b].decomposition
                                  for b in bucket[np.unique(member, return_index=True)[1]]])
    return durations, exposed.tolist(), report

  @functools.cached_property
  def _stretches(self) -> tuple[np.ndarray, np.ndarray]:
    """Per place in the run order: the first place of the run of kernels standing for several
    layers that it is in, and the place after that run's last (-1: a kernel standing for one)."""
    folded = self._unfolded_before[0]
    starts = folded & ~np.concatenate([[False], folded[:-1]])
    ends = np.flatnonzero(folded & ~np.concatenate([folded[1:], [False]])) + 1
    run = np.cumsum(starts) - 1
    begin = np.where(folded, np.flatnonzero(starts)[np.maximum(run, 0)], -1)
    end = np.where(folded, ends[np.maximum(run, 0)] if len(ends) else -1, -1)
    return begin, end

  def _run(self, ready, waits, durations, kernels, layers=None, layer=None) -> list[float]:
    """Per collective, the compute idle time spent while it ran.

    Kernels run in a fixed order (ProgramWork.order); the time at place p is the sum of the
    kernels before it plus the waits so far, so only the places where a collective is issued or
    first awaited are visited (once a kernel has waited for a collective, later readers find it
    done).

    `layers` (per collective): how many layers' issues of it a folded layer's stands for, and
    `layer`: the layer whose issue it is, for a bucket of layers' copies (-1: none); those the
    deep program makes a layer apart are issued as it does (`_spread`)."""
    n = len(durations)
    if not n:
      return []
    if not self.hardware.overlap_collectives:  # run in line
      return list(durations)
    before = np.concatenate([[0.0], np.cumsum(kernels)])     # compute before place p
    durations = np.asarray(durations, np.float64)
    at = before[ready]
    spread, wraps = None, {}
    if layers is not None and self.folding is not None:
      spread = self._spread(ready, waits, durations, layers, at, before,
                            np.full(n, -1) if layer is None else layer)
      if spread is not None:
        durations, at, ready, waits, owners, wraps = spread
    m = len(durations)
    durations = durations.tolist()
    awaited = np.nonzero(waits < _NEVER)[0]
    places = np.concatenate([ready, waits[awaited]])
    times = np.concatenate([at, before[waits[awaited]]])
    what = np.concatenate([np.zeros(m, np.int64), np.ones(len(awaited), np.int64)])
    which = np.concatenate([np.arange(m), awaited])
    order = np.lexsort((which, what, places, times))
    offset = network = 0.0
    done = [0.0] * m
    exposed = [0.0] * m
    issued, rank = [], [0] * m

    def wait(k, now):
      """The network is busy from now until k is done: charge the wait to the collectives that
      run in that time (k and those queued before it)."""
      j = rank[k]
      while j >= 0 and done[issued[j]] > now:
        q = issued[j]
        exposed[q] += min(done[q], done[k]) - max(done[q] - durations[q], now)
        j -= 1
      return done[k] - now

    for time, awaits, k in zip(times[order].tolist(), what[order].tolist(),
                               which[order].tolist()):
      now = time + offset
      if not awaits:
        if k in wraps:   # a wrapped part takes what the run's start leaves of its room
          owners_k, shares, room = wraps[k]
          back = durations[k] - max(room - max(network - now, 0.0), 0.0)
          if back > 0:
            for o, share in zip(owners_k.tolist(), shares.tolist()):
              durations[o] += back * share
            durations[k] -= back
        network = done[k] = max(network, now) + durations[k]
        rank[k] = len(issued)
        issued.append(k)
      elif done[k] > now:
        offset += wait(k, now)
    end = float(before[-1]) + offset
    if issued and done[issued[-1]] > end:   # collectives whose results only the outputs need
      wait(issued[-1], end)
    if spread is None:
      return exposed
    owner, event, share = owners
    out = np.array(exposed[:n])
    np.add.at(out, owner, np.asarray(exposed)[event] * share)
    return out.tolist()

  def _spread(self, ready, waits, durations, layers, at, before, layer):
    """Where the deep program issues the copies of a folded layer's collective that is made
    in a run of folded kernels and awaited after it (gradients reduced for the optimizer).

    The folded run is one layer slowed down: its collective is issued where one layer issues
    it and lasts as long as every layer's copy, so what it has left on the network when the
    run ends is every layer's tail, where the deep program leaves the last layer's:
    - in a run that awaits no collective of its own (a plain backward pass), the copies of
      the layers before the last are issued where the first layer makes it and the last
      layer's where the last layer does, so that the network carries over the run's end what
      it carries in the deep program: the last layer's copy, or the backlog where it is
      behind. A bucket of several layers' copies (`_combine`) is issued where its last
      layer makes them;
    - in a run that awaits collectives too (Megatron's, parameters gathered layer by layer),
      their order on the network decides, so the collective is issued where the folded layer
      issues it; where none of the run's awaited collectives is issued after it, what would
      run past the run's end is issued at its start instead (beside the next layer, as in the
      deep program), as far as the network time the run leaves takes it.
    Returns the events (durations, issue times, ready and awaited places); per share of an
    added event, the collective it is part of, the event and the share; and per wrapped part:
    the collectives it was cut from, their shares and the run's room (what the network is
    behind at the run's start takes from it, `_run`). None where nothing spreads."""
    begin, end = self._stretches
    made = np.maximum(ready - 1, 0)
    k = np.flatnonzero(((layers > 1) | (layer >= 0)) & (ready > 0) & (begin[made] >= 0) &
                       (waits >= end[made]) &
                       np.array(self._read_after_block(ready, waits), bool))
    if not len(k):
      return None
    runs, run = np.unique(begin[made[k]], return_inverse=True)
    start, stop = before[runs], before[end[runs]]
    issued = np.searchsorted(start, at, side="right") - 1      # the run each one is issued in
    inside = (issued >= 0) & (at < stop[np.maximum(issued, 0)])
    busy = np.bincount(issued[inside], durations[inside], minlength=len(runs))
    within = inside & (waits < end[runs][np.maximum(issued, 0)])   # awaited in the run
    awaits = (np.bincount(issued[within], minlength=len(runs)) > 0)[run]
    durations, at = durations.copy(), at.copy()
    # Awaiting: as the folded layer issues it, and what would run past the run's end at its
    # start, as far as the network time the run leaves (`room`) takes it.
    synced = np.full(len(runs), -np.inf)       # the last issue in the run awaited in it
    np.maximum.at(synced, issued[within], at[within])
    m = k[awaits & (at[k] > synced[run]) & (layer[k] < 0)]
    r = np.searchsorted(runs, begin[made[m]])
    room = np.maximum(stop - start - busy, 0.0)
    spill = np.maximum(at[m] + durations[m] - stop[r], 0.0)
    wrapped = spill * np.minimum(1.0, room[r] / np.maximum(
        np.bincount(r, spill, minlength=len(runs))[r], 1e-30))
    m, r, wrapped = m[wrapped > 0], r[wrapped > 0], wrapped[wrapped > 0]
    durations[m] -= wrapped
    into, w = np.unique(r, return_inverse=True)       # one wrapped part per run
    wrap = np.bincount(w, wrapped)
    first_wait = np.full(len(into), _NEVER, np.int64)
    np.minimum.at(first_wait, w, waits[m])
    # Awaiting none: the earlier layers' copies where the first layer makes it, the last
    # layer's where the last layer does; a bucket of layers' copies where its last layer is.
    one = ~awaits & (layer[k] >= 0)
    b, r3 = k[one], run[one]
    period = (stop - start)[r3] / (self.folding.depth - 2)
    at[b] = start[r3] + (layer[b] + (at[b] - start[r3]) / (stop - start)[r3]) * period
    a, r2 = k[~awaits & ~one], run[~awaits & ~one]
    early = durations[a] * (1 - 1 / layers[a])
    t = at[a]
    durations[a] -= early
    at[a] = stop[r2] - (stop[r2] - t) / layers[a]
    n = len(durations)
    event = n + w
    share = wrapped / wrap[w]
    wraps = {n + i: (m[w == i], share[w == i], room[into[i]]) for i in range(len(into))}
    return (np.concatenate([durations, wrap, early]),
            np.concatenate([at, start[into], start[r2] + (t - start[r2]) / layers[a]]),
            np.concatenate([ready, runs[into], ready[a]]),
            np.concatenate([waits, first_wait, waits[a]]),
            (np.concatenate([m, a]), np.concatenate([event, n + len(into) + np.arange(len(a))]),
             np.concatenate([share, np.ones(len(a))])), wraps)


@per_program
def _simulator(program, mesh, hardware, order, donate) -> Simulator:
  return Simulator(program, mesh, hardware, order, donate)


def simulate(pp, hardware: Hardware | str = "h100", order: Sequence[str] | None = None,
             donate: bool = True) -> CostReport:
  """Predicted per-device step time, communication and memory of a partitioned program.

  `order`: mesh axes major to minor in device numbering (minor axes fill a node first).
  `donate`: updated state reuses its input's buffer (as with jit's donate_argnums)."""
  return _simulator(pp.program, pp.mesh, load_hardware(hardware),
                    tuple(order) if order else None, donate)(pp)

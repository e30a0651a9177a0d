"""Pipelines for every agent.

`Pipeline` rewrites the program the environment is built on (stage-stacked weights, a loop
over micro-batches), so it is no action of the environment, whose decision points and
observations are those of the program as traced. Agents meet it after their episode instead:
the program is pipelined over the mesh's outermost axis at a few micro-batch counts, the same
agent decides the other axes of each (`Auto` over them: a search agent, or a trained policy
checked against the hand schedules by `launch.auto.solve`), and the hand schedules that
pipeline (`ptd-p`, `pp+dp`) are costed at the same counts; each of those plans also with its
hand-overs split over the innermost axis (`StageScatter`). The best of those is tried again
with interleaved stages (`VIRTUAL` chunks a device: a smaller bubble for more hand-overs and a
gather of each chunk's weights). The best of all wins where it beats the episode's plan by the
one rule (`corpus.experts.preference`: what fits first, then the fastest).

Which micro-batch counts: those that divide the batch, nearest 2, 4, 8 and 16 a stage
(`PER_STAGE`; fewer for the agents that must answer in seconds), preferring those whose
micro-batch also divides over the data axes. More micro-batches shrink the bubble
((S-1)/(M+S-1)) and the activations a stage keeps, and make each stage's matmuls smaller.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

from corpus.experts import preference
from partitioner.errors import ShardzeroError
from partitioner.ir import per_program

PER_STAGE = (2, 4, 8, 16)   # micro-batches per stage tried by default
VIRTUAL = (2, 3)            # chunks a device the best 1F1B plan is tried interleaved with


class Pipelined(NamedTuple):
  """The best pipelined plan found: its micro-batches, what decided the other axes (`base`:
  the agent, or a hand schedule's name), the partitioned program, its cost and schedule."""
  k: int
  base: str
  pp: object
  cost: object
  schedule: str


def microbatch_counts(batch: int, stages: int, data: int,
                      per_stage: Sequence[int] = PER_STAGE) -> tuple[int, ...]:
  """Micro-batch counts for a batch of `batch` over `stages` stages: divisors of the batch
  from `stages` to 16 a stage, those whose micro-batch divides over `data` devices where any
  does, the one nearest each of `per_stage` stages' worth."""
  divides = [m for m in range(stages, 16 * stages + 1) if batch % m == 0]
  counts = [m for m in divides if (batch // m) % data == 0] or divides
  return tuple(sorted({min(counts, key=lambda m: abs(m - k * stages)) for k in per_stage})
               if counts else ())


def _data_size(mesh) -> int:
  """The devices a micro-batch is split over: every axis but the pipeline's (the outermost)
  and the innermost (tensor parallelism, within a node); the second on a mesh of two."""
  names = mesh.names
  return (math.prod(mesh.size(a) for a in names[1:-1]) if len(names) > 2 else
          mesh.size(names[1]))


def _with_count(schedule, m: int) -> list:
  """A hand schedule's tactics with its pipeline streaming `m` micro-batches."""
  from partitioner.tactics import Pipeline, parse_schedule
  return [dataclasses.replace(t, microbatches=m) if isinstance(t, Pipeline) else t
          for t in parse_schedule(schedule)]


def floor_s(program, mesh, hardware, counts: Sequence[int], virtual: Sequence[int] = ()) -> float:
  """No pipeline over `mesh`'s outermost axis (S stages) at `counts` micro-batches runs a step
  in less: the step's computation on one device shared evenly by every device (a split
  computes no less than its share: the simulator prices work, bytes and launches per kernel),
  stretched by the smallest bubble, (M+S-1)/M at the most micro-batches M (interleaving
  divides the bubble by its chunks). Plans faster than this leave nothing to try."""
  stages, m = mesh.size(mesh.names[0]), max(counts) * max((1, *virtual))
  return even_share_s(program, mesh, hardware) * (1 + (stages - 1) / m)


def even_share_s(program, mesh, hardware) -> float:
  """No plan of `program` over `mesh` runs a step in less: its computation on one device shared
  evenly by every device (a split computes no less than its share: the simulator prices work,
  bytes and launches per kernel; cutting the batch or recomputing only adds)."""
  return _whole_compute_s(program, mesh, hardware) / math.prod(mesh.size(a) for a in mesh.names)


@per_program
def _whole_compute_s(program, mesh, hardware) -> float:
  """The step's computation unsplit, on one device (each agent's try asks again)."""
  from partitioner.cost import simulate
  from partitioner.partition import PartitionedProgram
  return simulate(PartitionedProgram(program, mesh), hardware).compute_s


def pipelined(program, mesh, hardware, budget: int, decide: Callable[[str], object] | None,
              solver=None, *, base: str = "agent", hand: Sequence[tuple[str, str]] = (),
              per_stage: Sequence[int] = PER_STAGE, beat=None, faster_than: float = math.inf,
              decide_each: bool = True, virtual: Sequence[int] = VIRTUAL) -> Pipelined | None:
  """The best plan that pipelines `program` over `mesh`'s outermost axis: for each
  micro-batch count, `decide(rest)` (an `Auto` tactic over the other axes, applied with
  `solver`) and each pipelining hand schedule of `hand` ((name, schedule) pairs). With
  `decide_each` False, `decide` runs once, at the most micro-batches (the smallest bubble,
  which wins most often), and what it chose is replayed at the other counts: the other axes'
  plan hardly depends on the micro-batch's size, and an agent that must answer in seconds
  cannot decide at each. The best is then replayed interleaved with each of `virtual` chunks a
  device (where the stages divide its micro-batches and the layers divide into the chunks).
  Only one that beats `beat` (a CostReport; None: anything) by `preference` counts. Where the
  time to beat (`beat`'s where it fits, or `faster_than`, the caller's) is no more than
  `floor_s`, nothing is tried: on Megatron-LM's 1.7B and 3.6B that is 2-3 s of a policy's
  answer (the pipelined program traced twice, the policy run on it). None where the program
  has no scanned layer stack, the mesh one axis, or nothing beats `beat`."""
  from partitioner.cost import simulate
  from partitioner.microbatch import batch_inputs
  from partitioner.partition import PartitionedProgram
  from partitioner.tactics import Pipeline, parse_schedule
  names = mesh.names
  if len(names) < 2 or mesh.size(names[0]) < 2 or not program.loops:
    return None
  try:
    _, n = batch_inputs(program, 1, "Pipeline")
  except ShardzeroError:
    return None
  standing = lambda c: preference(c.step_time_s, c.peak_memory_bytes,
                                  c.peak_memory_bytes <= budget)
  best, best_key = None, None if beat is None else standing(beat)
  stages = mesh.size(names[0])
  rest = "+".join(names[1:])
  chosen = None   # the tactics `decide` chose, where it decides once
  counts = microbatch_counts(n, stages, _data_size(mesh), per_stage)
  target = min(faster_than, beat.step_time_s if beat is not None and
               beat.peak_memory_bytes <= budget else math.inf)
  if not counts or (target < math.inf and target <= floor_s(program, mesh, hardware, counts,
                                                            virtual)):
    return None
  for m in (counts if decide_each else counts[::-1]):
    tries = []
    if decide is not None:
      tries.append((base, [Pipeline(names[0], microbatches=m)] +
                    ([decide(rest)] if chosen is None else chosen), chosen is None))
    tries += [(name, _with_count(schedule, m), False) for name, schedule in hand
              if schedule.split(";")[0].strip() == f"Pipeline({names[0]})"]
    for name, tactics, deciding in tries:
      try:
        pp = PartitionedProgram(program, mesh).apply(tactics, solver=solver)
      except ShardzeroError:   # no stack, a batch that does not divide, nothing fits the rest
        continue
      if deciding and not decide_each:
        choice = pp.decided.split(";", 1)
        chosen = parse_schedule(choice[1]) if len(choice) > 1 else []
      for plan in (pp, _scattered(pp, names[-1])):
        if plan is None:
          continue
        cost = simulate(plan, hardware)
        if best_key is None or standing(cost) < best_key:
          best, best_key = Pipelined(m, name, plan, cost, plan.decided), standing(cost)
  for v in (virtual if best is not None else ()):
    tactics = [dataclasses.replace(t, schedule="interleaved", virtual=v)
               if isinstance(t, Pipeline) else t for t in parse_schedule(best.schedule)]
    try:
      plan = PartitionedProgram(program, mesh).apply(tactics)
    except ShardzeroError:   # the stages do not divide the micro-batches, or the chunks the layers
      continue
    cost = simulate(plan, hardware)
    if standing(cost) < best_key:
      best, best_key = best._replace(pp=plan, cost=cost, schedule=plan.decided), standing(cost)
  return best


def _scattered(pp, axis: str):
  """`pp` with its hand-overs split over `axis` (`StageScatter`: less to send between stages
  and to keep, a gather where the layers read them); None where that does not apply."""
  from partitioner.tactics import StageScatter
  try:
    return pp.apply([StageScatter(axis)])
  except ShardzeroError:
    return None

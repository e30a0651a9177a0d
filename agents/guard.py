"""A trained policy's plan, checked against the hand schedules before anyone is given it.

A policy is only as good as the programs it trained on. Asked for plans for real programs in
other idioms at 64-1024 devices, the scales policy was 5-28x slower than the best known, and
some of its plans did not fit in memory, while the generic hand schedules (`corpus.experts`:
data parallelism, ZeRO 1-3, HSDP, Megatron and their mixtures) were never far off. Costing
them takes seconds, the environment's cache of states shared with the policy's own line. So
`propose`, `Auto(policy=...)` and the guarded evaluation agents play the policy, cost the hand
schedules from the same start, and play the best by the one rule (`corpus.experts.preference`):
what fits before what does not, then the fastest. The policy wins ties.

`fit_with_microbatches` then cuts the batch of the fastest plans that do not fit into
micro-batches (`partitioner.Microbatch`), or recomputes their activations in the backward pass
(`partitioner.Remat`, then cut where that alone does not fit), which shrinks activations and
leaves the rest of a plan as it is: where nothing fits, or where a plan faster than the answer
fits so (the environment's own cuts end an episode: the policy's line may end cut already,
and the hand schedules are cut here, at more counts than the environment offers). It also
costs the pipelined hand schedules, which stream micro-batches through stages, and the plans
that split attention over an axis its heads do not divide again with the heads padded
(`HeadPadding`): rewrites of the program, which the environment cannot play.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from agents.decoding import TrainedPolicy, play_policy
from agents.pipelines import PER_STAGE, even_share_s, pipelined
from agents.search.expert import ExpertPlay, evaluate_experts
from agents.search.planning import path_to, play
from corpus.experts import preference
from partitioner.errors import ShardzeroError


class Guarded(NamedTuple):
  """What `play_guarded` played and why."""
  winner: str                   # "policy", or the name of the hand schedule that beat it
  fits: bool                    # whether what was played fits the budget (False: nothing did)
  policy_step_s: float          # the policy's own plan, as the simulator costs it
  policy_peak_bytes: float
  policy_fits: bool
  policy_argument_bytes: float  # of its peak, the inputs (parameters, optimizer state, batch)
  policy_schedule: str
  best_hand: ExpertPlay | None  # the best hand schedule (None where none applies)
  hand: tuple[ExpertPlay, ...]  # every hand schedule, with why those that did not apply failed
  policy_s: float               # seconds the policy took to decide
  simulations: int              # the policy-guided search's simulations (0 for greedy)
  guard_s: float                # seconds costing the hand schedules took

  @property
  def policy_won(self) -> bool:
    return self.winner == "policy"

  @property
  def step_s(self) -> float:
    """The step time of what was played."""
    return self.policy_step_s if self.policy_won else self.best_hand.cost.step_time_s

  def summary(self) -> str:
    """One line: which plan won and by how much."""
    hand = self.best_hand
    if hand is None:
      return "no hand schedule applies here; the policy's plan stands"
    h_s, p_s = hand.cost.step_time_s, self.policy_step_s
    memory = self.policy_peak_bytes / hand.cost.peak_memory_bytes
    if not self.policy_fits and not hand.fits:
      closest = "the policy's plan" if self.policy_won else f"the hand schedule {hand.name}"
      return (f"nothing fits; {closest} comes closest (the policy's plan needs {memory:.2f}x "
              f"the memory of the best hand schedule, {hand.name})")
    if self.policy_won:
      if not hand.fits:
        return f"the policy's plan fits; the best hand schedule ({hand.name}) does not"
      margin = f"{h_s / p_s - 1:.1%} faster than" if p_s < h_s * (1 - 1e-9) else "as fast as"
      return f"the policy's plan is {margin} the best hand schedule ({hand.name})"
    why = f"{p_s / h_s:.2f}x its step time" if self.policy_fits else "over the memory budget"
    return f"the hand schedule {hand.name} beat the policy's plan ({why})"


def play_guarded(env, policy: TrainedPolicy, search: str = "greedy",
                 budget: int = 50) -> Guarded:
  """Plays in `env`, from its current state to the end, the better of `policy`'s plan (greedy
  or policy-guided MCTS with `budget` simulations, `agents.decoding.play_policy`) and the best
  hand schedule for the task's program over the axes it acts on."""
  start = len(env.history)
  line = env.clone()
  # Uncut: `fit_with_microbatches` cuts the policy's plan and the fastest hand schedules after,
  # at more counts; the policy's own walk back through its line would trace the step again at
  # each count it tries (16-20 s on HF Llama 7B at 64-1024 H100s) for what those find.
  policy_s, simulations = play_policy(line, policy, search, budget, cut=False)
  began = time.perf_counter()
  hand = tuple(evaluate_experts(env))
  ran = [h for h in hand if h.cost is not None]
  best_hand = min(ran, key=lambda h: preference(h.cost.step_time_s, h.cost.peak_memory_bytes,
                                                h.fits), default=None)
  cost = line.exact_cost
  policy_fits = cost.peak_memory_bytes <= line.context.budget
  mine = preference(cost.step_time_s, cost.peak_memory_bytes, policy_fits)
  if best_hand is None or mine <= preference(best_hand.cost.step_time_s,
                                             best_hand.cost.peak_memory_bytes, best_hand.fits):
    play(env, path_to(line, start))
    winner, fits = "policy", policy_fits
  else:
    play(env, best_hand.actions)
    if not env.done:
      env.step(env.finish_action)
    winner, fits = best_hand.name, bool(best_hand.fits)
  return Guarded(winner, fits, cost.step_time_s, cost.peak_memory_bytes, policy_fits,
                 cost.memory.argument_bytes,
                 line.partitioned.strategy, best_hand, hand, policy_s, simulations,
                 time.perf_counter() - began)


def _first_count(peak: float, arguments: float, budget: float) -> int | None:
  """The fewest micro-batches (2, 4, 8...) that could fit a plan whose peak is `peak` with
  `arguments` of it its inputs: None where the inputs alone are over `budget` (cutting the
  batch leaves them whole); else the count at which the rest, shrinking k-fold (it shrinks no
  faster), would fit. Each count traces the step again (0.6 s for Megatron-LM's 1T on 2
  cores), so counts that cannot fit are not tried."""
  if arguments >= budget:
    return None
  return max(2, 2 ** math.ceil(math.log2(max(1.0, (peak - arguments) / (budget - arguments)))))


def _next_count(peak: float, k: int, peak_k: float, budget: float) -> int | None:
  """After `k` micro-batches did not fit (peak `peak_k`, `peak` uncut): the count that would,
  were the peak `fixed + shrinking / k` through both; None where nothing would (what does not
  shrink is over `budget`: gradient accumulators, gathered weights)."""
  shrinking = (peak - peak_k) / (1 - 1 / k)
  fixed = peak - shrinking
  if shrinking <= 0 or fixed >= budget:
    return None
  return max(2 * k, 2 ** math.ceil(math.log2(shrinking / (budget - fixed))))


class Microbatched(NamedTuple):
  """A plan that fits once its batch is cut into `k` micro-batches (or streamed through
  pipeline stages in them: `pp.program.stages > 1`), its activations recomputed (`Remat`), or
  its attention heads padded to split (`HeadPadding`); those rewrites come first in
  `pp.schedule`, and `k` = 1 where the batch is not cut as well."""
  k: int
  base: str          # the plan it cuts: "policy" or a hand schedule's name
  pp: object         # the partitioned (rewritten) task program
  cost: object       # its CostReport


def fit_with_microbatches(ctx, guarded: Guarded, faster_than: float | None = None,
                          plans: int = 3, largest: int = 64, decide=None, solver=None,
                          per_stage=PER_STAGE) -> Microbatched | None:
  """The plans that do not fit and are faster than `faster_than` (by default what `guarded`
  played, where it fits; any time where nothing fits) — the policy's and the hand schedules,
  the `plans` fastest — again with the batch cut into 2, 4, 8... micro-batches, up to
  `largest`, each with the fewest that fit (counts that cannot fit are not traced:
  `_first_count`, `_next_count`), and with their activations recomputed
  (`recomputed_to_fit`); then pipelines (`agents.pipelines`: the pipelining hand
  schedules, and `decide`, the policy as an `Auto` over the other axes with `solver`,
  deciding at the most of `per_stage` micro-batches a stage and replayed at the others); then
  every plan again with its attention heads padded where they do not divide its Megatron axis
  (`with_heads_padded`): the fastest of those that fit and beat `faster_than`. None where none
  does."""
  from partitioner.tactics import Microbatch, Remat, parse_schedule
  from environments.tasks import load_program
  candidates = [("policy", guarded.policy_schedule, guarded.policy_step_s,
                 guarded.policy_fits, guarded.policy_peak_bytes,
                 guarded.policy_argument_bytes)] + [
      (h.name, h.schedule, h.cost.step_time_s, h.fits, h.cost.peak_memory_bytes,
       h.cost.memory.argument_bytes) for h in guarded.hand if h.cost is not None]
  if faster_than is None:
    faster_than = guarded.step_s if guarded.fits else float("inf")
  candidates = sorted((c for c in candidates if not c[3] and c[2] < faster_than),
                      key=lambda c: c[2])
  program = load_program(ctx.task.model)
  best = None
  for name, schedule, _, _, peak, arguments in candidates[:plans]:
    tactics = [t for t in parse_schedule(schedule) if not isinstance(t, (Microbatch, Remat))]
    for cut in (cut_to_fit(program, ctx, (), tactics, peak, arguments, largest),
                recomputed_to_fit(program, ctx, tactics, largest)):
      if cut is not None and cut[2].step_time_s < faster_than and (
          best is None or cut[2].step_time_s < best.cost.step_time_s):
        best = Microbatched(cut[0], name, cut[1], cut[2])
  # Hand schedules that rewrite the program first (pipelines, `pp+dp` and `ptd-p`) are not
  # actions of the environment, which is built on the program as traced; they are costed here,
  # on the task's program, at a few micro-batch counts, with the policy's own pipelined plan.
  limit = faster_than if best is None else min(faster_than, best.cost.step_time_s)
  hand = [(h.name, h.schedule) for h in guarded.hand
          if h.cost is None and h.schedule.startswith("Pipeline(")]
  # Not interleaved: each try emits the pipeline again (0.6-1.6 s at Megatron-LM's sizes), where
  # a policy answers in under two seconds and interleaving gains a few percent at best.
  staged = pipelined(program, ctx.mesh, ctx.task.hardware, ctx.budget, decide, solver,
                     base="policy", hand=hand, per_stage=per_stage, faster_than=limit,
                     decide_each=False, virtual=())
  if staged is not None and staged.cost.peak_memory_bytes <= ctx.budget and \
      staged.cost.step_time_s < limit:
    best = Microbatched(staged.k, staged.base, staged.pp, staged.cost)
  limit = faster_than if best is None else min(faster_than, best.cost.step_time_s)
  everything = [("policy", guarded.policy_schedule)] + [
      (h.name, h.schedule) for h in guarded.hand if h.cost is not None]
  padded = with_heads_padded(program, ctx, everything, limit, largest)
  return padded or best


def cut_to_fit(program, ctx, rewrites, tactics, peak: float, arguments: float,
                largest: int):
  """(k, partitioned program, cost) of `rewrites` then `Microbatch(k)` then `tactics` on
  `program`, with the fewest micro-batches (2, 4, 8... up to `largest`) that fit the budget,
  given the plan's uncut peak and the inputs' share of it; None where none does (counts that
  cannot fit are not traced: `_first_count`, `_next_count`)."""
  from partitioner.cost import simulate
  from partitioner.partition import PartitionedProgram
  from partitioner.tactics import Microbatch
  k = _first_count(peak, arguments, ctx.budget)
  while k is not None and k <= largest:
    try:
      pp = PartitionedProgram(program, ctx.mesh).apply([*rewrites, Microbatch(k), *tactics])
    except ShardzeroError:   # the batch does not divide, or the step cannot be cut
      return None
    cost = simulate(pp, ctx.task.hardware)
    if cost.peak_memory_bytes <= ctx.budget:
      return k, pp, cost
    k = _next_count(peak, k, cost.peak_memory_bytes, ctx.budget)
  return None


def recomputed_to_fit(program, ctx, tactics, largest: int):
  """(k, partitioned program, cost) of `Remat()` then `tactics` on `program`, where the
  recomputed activations fit the budget (k = 1), or else with the fewest micro-batches that
  fit (`cut_to_fit`); None where none does or the step cannot be recomputed (a scanned stack,
  one written with `jax.checkpoint`)."""
  from partitioner.cost import simulate
  from partitioner.partition import PartitionedProgram
  from partitioner.tactics import Remat
  try:
    pp = PartitionedProgram(program, ctx.mesh).apply([Remat(), *tactics])
  except ShardzeroError:
    return None
  cost = simulate(pp, ctx.task.hardware)
  if cost.peak_memory_bytes <= ctx.budget:
    return 1, pp, cost
  return cut_to_fit(program, ctx, [Remat()], tactics, cost.peak_memory_bytes,
                    cost.memory.argument_bytes, largest)


def with_heads_padded(program, ctx, plans, faster_than: float,
                      largest: int = 64) -> Microbatched | None:
  """The fastest of `plans` ((name, schedule) pairs) that apply Megatron over an axis some
  attention's heads do not divide (12 heads over 8 devices, which it leaves whole on every
  device), again after `HeadPadding` over that axis (and where that is over the budget, with
  the fewest micro-batches that fit, up to `largest`), where it fits and beats `faster_than`;
  None where none does. Like a pipeline, the padding rewrites the program, which the
  environment cannot play."""
  from partitioner.cost import simulate
  from partitioner.heads import pad_heads
  from partitioner.partition import PartitionedProgram
  from partitioner.tactics import HeadPadding, Megatron, Microbatch, parse_schedule
  best = None
  for name, schedule in plans:
    tactics = [t for t in parse_schedule(schedule) if not isinstance(t, Microbatch)]
    for axis in dict.fromkeys(t.axis for t in tactics if isinstance(t, Megatron)):
      try:
        padded = pad_heads(program, ctx.mesh.size(axis))
        if padded is program or even_share_s(padded, ctx.mesh,
                                              ctx.task.hardware) >= faster_than:
          continue   # nothing to pad, or nothing padded could beat `faster_than`
        pp = PartitionedProgram(program, ctx.mesh).apply([HeadPadding(axis)] + tactics)
      except ShardzeroError:
        continue
      cost, k = simulate(pp, ctx.task.hardware), 1
      if cost.peak_memory_bytes > ctx.budget:
        cut = cut_to_fit(program, ctx, [HeadPadding(axis)], tactics, cost.peak_memory_bytes,
                          cost.memory.argument_bytes, largest)
        if cut is None:
          continue
        k, pp, cost = cut
      if cost.step_time_s < faster_than and (
          best is None or cost.step_time_s < best.cost.step_time_s):
        best = Microbatched(k, name, pp, cost)
  return best

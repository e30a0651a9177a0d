"""An integer-programming baseline in the style of Alpa's intra-operator pass and XLA's
auto-sharding, over the environment's decision points.

Alpa gives every op a choice among its sharding strategies, a node cost per choice and an edge
cost per pair of choices on a producer and its consumer (resharding), and linearises the
quadratic edge terms. Here the choices are the environment's actions (tile one decision point,
the same input in every layer, along a dimension over a mesh axis; and the manual tactics), so
layers share variables and the program's depth does not grow the model. The costs come from
the simulator itself: a node cost is what one action alone changes, an edge cost what two
together change beyond the sum of their own (the resharding or the collective one saves or
causes the other); pairs that cannot be taken together exclude each other. The objective is
the log of compute plus collective time and the memory constraint the log of peak bytes (in
logs, sharding over two axes is the sum of sharding over each).

What a pairwise model misses (three actions together) is its linearisation error: the solution
is replayed and costed by the full simulator, actions are dropped from it while that helps,
and a further round linearises around the state reached while that improves it. Every state
costed to build the model (one action, a pair, and every triple of manual tactics, which are
few and interact most) is a plan as well: where one of them beats the solution replayed, the
round keeps it, as Alpa enumerates outside its ILP what the ILP does not model (there, the
logical mesh shapes). On a task played folded the round's plan and the SHORTLIST best costed
states are compared on the whole program, the folded estimate being off by as much as they
differ. `Solution.enumerated` counts the rounds this decided. Solved with
HiGHS through `scipy.optimize.milp`, with a time limit; the MIP gap is reported.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import NamedTuple

import numpy as np

from agents.search.planning import Plan, PlanningActor, cut_if_over, play
from environments.actions import ENDINGS
from environments.protocols import SearchEnvironment

CANDIDATES = 32      # actions given a variable (see `_candidates`)
POOL = 48            # actions whose pairs are costed (see `_round`)
ROUNDS = 3           # solves at most, each linearised where the last one got to
NEGLIGIBLE = 1e-3    # edge terms below this (in log time and log memory, ~0.1%): dropped
MEMORY_SLACK = 0.05  # log memory the model may be off by on a plan before it is solved again
SHORTLIST = 4        # costed states that go to the final comparison beside the plan


class Solution(NamedTuple):
  """What the solves found, and the size and figures of the first (the baseline proper)."""
  actions: tuple[int, ...]    # chosen, in replay order, over all rounds
  skipped: tuple[int, ...]    # chosen but illegal when replayed (three-way interactions)
  objective_s: float          # the first ILP's predicted serial time (compute + collectives)
  simulated_s: float          # the simulator's serial time of all the first ILP's actions
  memory_bytes: float         # the first ILP's predicted peak memory
  status: str                 # HiGHS' message (first round)
  gap: float | None           # relative MIP gap at the end (0: proven optimal; first round)
  variables: int
  constraints: int
  rounds: int                 # solves whose actions were kept
  enumerated: int             # of those, rounds where a costed state beat the solution
  simulations: int            # one- and two-action states costed to build the models
  build_s: float
  solve_s: float


class ILPActor(PlanningActor):
  """Solves at the start of each episode and plays the solution.

  `manual`: also offer the manual tactics (BatchParallel, Megatron, ZeRO, ...) as choices,
  as the other agents have them; without, the baseline knows nothing but layouts and the
  simulator, as Alpa's does.
  """

  def __init__(self, environment: SearchEnvironment, time_limit_s: float = 60.0,
               manual: bool = True, rounds: int = ROUNDS):
    super().__init__(environment)
    self.time_limit_s, self.manual, self.rounds = time_limit_s, manual, rounds
    self.solution: Solution | None = None

  def plan(self, env: SearchEnvironment) -> Plan:
    self.solution = solve(env, self.time_limit_s, self.manual, self.rounds)
    play(env, self.solution.actions)
    cut = cut_if_over(env)
    play(env, cut)
    actions = self.solution.actions + cut + ((env.finish_action,) if not env.done else ())
    return Plan(actions, env.score(), self.solution.simulations, 0.0)


_ROLE_RANK = {"data": 0, "param": 2, "opt": 3}


def _rank(ctx, action: int) -> float:
  """Replay order: data layouts and `BatchParallel` first (they decide what the batch axes
  mean), then expert placement, then the other manual tactics, then parameters, then optimizer
  state, as expert schedules are written (`corpus.experts`' GShard: the batch over the data
  axes, the experts, the batch over their axis). Earlier tactics win propagation conflicts;
  `ExpertParallel` acts before what split the batch over its own axis wherever it is replayed
  (`partitioner.partition`), so the tokens move to the experts."""
  a = ctx.actions[action]
  if a.kind == "tile":
    return _ROLE_RANK.get(ctx.points[a.point].role, 1)
  return {"BatchParallel": 0, "ExpertParallel": 0.5}.get(a.kind, 1)


def _serial(cost) -> float:
  """The log of compute plus all collective time. Compute plus collectives is additive over
  ops and collectives (step time, a max of overlapping sums, makes everything interact), and
  its log makes sharding's effects additive too: splitting the batch over two axes divides
  the work twice, which a sum of two node costs can only say in logs."""
  return math.log(cost.compute_s + cost.comm_s)


def _memory(cost) -> float:
  """The log of peak bytes per device (sharding divides it, as it divides time)."""
  return math.log(cost.peak_memory_bytes)


def _after(env: SearchEnvironment, action: int) -> SearchEnvironment:
  trial = env.clone()
  trial.step(action)
  return trial


def _standing(env: SearchEnvironment, exact: bool = False) -> tuple[bool, float]:
  """Orders states: fitting the budget first, then by step time (changes under NEGLIGIBLE
  are ties). `exact`: costed on the task's whole program where it is played folded, for the
  few final comparisons, where the folded estimate's error (a few % with launches and
  combining) is as large as the differences between the plans compared."""
  cost = env.exact_cost if exact and env.context.folding is not None else env.cost
  return (cost.peak_memory_bytes > env.context.budget,
          round(math.log(cost.step_time_s) / NEGLIGIBLE))


class _Round(NamedTuple):
  env: SearchEnvironment        # after the round's actions
  actions: tuple[int, ...]
  skipped: tuple[int, ...]
  objective: float            # log serial time predicted
  replayed: float             # log serial time of the whole solution replayed
  memory: float               # log peak memory predicted
  status: str
  gap: float | None
  size: tuple[int, int]
  enumerated: bool            # a state costed to build the model beat the solution
  simulations: int
  build_s: float
  solve_s: float
  standing: tuple | None      # `_standing(env, exact=True)`; None where nothing was chosen


def solve(env: SearchEnvironment, time_limit_s: float = 60.0, manual: bool = True,
          rounds: int = ROUNDS) -> Solution:
  """The ILP of `env`'s task from its current state (`env` is not stepped), then up to
  `rounds - 1` more, each linearised around the state the previous one reached, while they
  improve on it (fit the budget, or lower the simulated step time). What a pairwise model
  misses of three actions together, the next one sees as one action beside two taken."""
  first = _round(env, time_limit_s, manual)
  best, taken = first, [first]
  while len(taken) < rounds and best.actions and not best.env.done:
    nxt = _round(best.env, time_limit_s, manual)
    taken.append(nxt)
    if not nxt.actions or nxt.standing >= best.standing:
      break
    best = nxt
  kept = taken[:taken.index(best) + 1]
  return Solution(sum((r.actions for r in kept), ()), sum((r.skipped for r in kept), ()),
                  math.exp(first.objective), math.exp(first.replayed),
                  math.exp(first.memory), first.status, first.gap, *first.size, len(kept),
                  sum(r.enumerated for r in kept), sum(r.simulations for r in taken),
                  sum(r.build_s for r in taken),
                  sum(r.solve_s for r in taken))


def _round(env: SearchEnvironment, time_limit_s: float, manual: bool) -> _Round:
  start = time.perf_counter()
  ctx, budget = env.context, env.context.budget
  steps_left = env.config.max_steps - len(env.history)
  t0, m0 = _serial(env.cost), _memory(env.cost)
  # Not `Microbatch` nor `Remat`: they end the episode, so they compose with nothing after
  # them (the plan ends rewritten where it is over the budget: `ILPActor.plan`).
  choices = sorted((int(a) for a in env.legal_actions()
                    if a != ctx.finish and ctx.actions[a].kind not in ENDINGS
                    and (manual or ctx.actions[a].kind == "tile")),
                   key=lambda a: (_rank(ctx, a), a))
  if steps_left < 2 or not choices:
    return _Round(env, (), (), t0, t0, m0, "nothing to choose", 0.0, (0, 0), False, 0,
                  0.0, 0.0, None)
  # Node costs: every action alone; edge costs: the legal pairs (in replay order) among the
  # POOL actions that do most for time alone and the POOL // 3 that do most for memory.
  singles = [_after(env, a) for a in choices]
  sims, n = len(choices), len(choices)
  dt = np.array([_serial(e.cost) for e in singles]) - t0
  dm = np.array([_memory(e.cost) for e in singles]) - m0
  is_manual = np.array([ctx.actions[a].kind != "tile" for a in choices])
  if n > POOL:
    idx = sorted(set(np.argsort(dt, kind="stable")[:POOL].tolist()) |
                 set(np.argsort(dm, kind="stable")[:POOL // 3].tolist()) |
                 set(np.flatnonzero(is_manual).tolist()))
    choices, singles, dt, dm, is_manual = ([choices[i] for i in idx],
                                           [singles[i] for i in idx], dt[idx], dm[idx],
                                           is_manual[idx])
    n = len(choices)
  et, em = np.full((n, n), np.nan), np.full((n, n), np.nan)
  manual_pairs, costed = {}, heapq.nsmallest(SHORTLIST, singles, key=_standing)
  for x in range(n):
    after = set(singles[x].legal_actions().tolist())
    for y in range(x + 1, n):
      if choices[y] in after:
        pair = _after(singles[x], choices[y])
        et[x, y] = _serial(pair.cost) - t0 - dt[x] - dt[y]
        em[x, y] = _memory(pair.cost) - m0 - dm[x] - dm[y]
        if is_manual[x] and is_manual[y]:
          manual_pairs[x, y] = pair
        costed = heapq.nsmallest(SHORTLIST, costed + [pair], key=_standing)
  sims += int(np.isfinite(et).sum())
  # Triples only where three actions still leave a step to finish, as the MILP's plans do.
  best_triple, triples = _best_triple(choices, manual_pairs if steps_left > 3 else {})
  sims += triples
  if best_triple is not None:
    costed = heapq.nsmallest(SHORTLIST, costed + [best_triple], key=_standing)
  keep = _candidates(dt, dm, et, em, CANDIDATES)
  build_s = time.perf_counter() - start
  t_solve = time.perf_counter()
  room = math.log(budget) - m0
  z, objective, memory, status, gap, size = _milp(
      dt[keep], dm[keep], et[np.ix_(keep, keep)], em[np.ix_(keep, keep)], room,
      steps_left - 1, time_limit_s)
  chosen = [choices[keep[i]] for i in np.flatnonzero(z)]
  whole, skipped = _replay(env, chosen)
  # Peaks are not additive: where the plan replayed misses the budget the model thought it
  # met, or fits with room to spare that the model thought it used, solve once more with the
  # room moved by the model's error.
  error = m0 + memory - _memory(whole.cost)
  if (error < 0) != whole.fits and abs(error) > MEMORY_SLACK:
    again = _milp(dt[keep], dm[keep], et[np.ix_(keep, keep)], em[np.ix_(keep, keep)],
                  room + error, steps_left - 1, time_limit_s)
    other = [choices[keep[i]] for i in np.flatnonzero(again[0])]
    replayed = _replay(env, other)
    if _standing(replayed[0]) < _standing(whole):
      (z, objective, memory, status, gap, size), chosen = again, other
      whole, skipped = replayed
  solve_s = time.perf_counter() - t_solve
  # Replay in order (an action made illegal by two others is skipped), then drop actions
  # while that helps: where three or more actions together undo what pairs promised, the
  # action that breaks the rest is left out rather than paid for.
  best, kept = whole, [a for a in chosen if a not in skipped]
  while kept:
    trials = [(_replay(env, kept[:i] + kept[i + 1:])[0], i) for i in range(len(kept))]
    sims += len(kept) * (len(kept) - 1)
    trial, i = min(trials, key=lambda t: _standing(t[0]))
    if _standing(trial) >= _standing(best):
      break
    best, kept = trial, kept[:i] + kept[i + 1:]
  finalists = [best] + costed
  standings = [_standing(e, exact=True) for e in finalists]
  i = min(range(len(finalists)), key=standings.__getitem__)
  enumerated, best = i > 0, finalists[i]
  return _Round(best, best.history[len(env.history):], tuple(skipped), t0 + objective,
                _serial(whole.cost), m0 + memory, status, gap, size, enumerated, sims, build_s,
                solve_s, standings[i])


def _replay(env: SearchEnvironment, actions) -> tuple[SearchEnvironment, tuple[int, ...]]:
  """`env` after `actions` in order, skipping those illegal when their turn comes."""
  trial, skipped = env.clone(), []
  for a in actions:
    if a in trial.legal_actions():
      trial.step(a)
    else:
      skipped.append(a)
  return trial, tuple(skipped)


def _best_triple(choices, manual_pairs):
  """The best state of three manual tactics taken together (in replay order), and how many
  were costed. Manual tactics interact beyond pairs (`BatchParallel(model)` beside
  `Megatron(model)` pays off only once the batch axis is data-parallel too), and there are few
  of them (a dozen or two), so all their legal triples are costed outright."""
  best, count = None, 0
  for (x, y), pair in manual_pairs.items():
    after = set(pair.legal_actions().tolist())
    for z in range(y + 1, len(choices)):
      if (x, z) in manual_pairs and (y, z) in manual_pairs and choices[z] in after:
        triple, count = _after(pair, choices[z]), count + 1
        best = triple if best is None else min(best, triple, key=_standing)
  return best, count


def _candidates(dt, dm, et, em, count: int) -> np.ndarray:
  """The actions worth a variable: the `count` that save most step time alone or with their
  best partner, and the `count // 4` that save most memory so; in replay order."""
  pair_t = dt[:, None] + dt[None, :] + et
  pair_m = dm[:, None] + dm[None, :] + em
  both = lambda m: np.fmin(m, m.T)
  best_t = np.fmin(dt, np.nanmin(np.where(np.isfinite(both(pair_t)), both(pair_t), np.inf), 1))
  best_m = np.fmin(dm, np.nanmin(np.where(np.isfinite(both(pair_m)), both(pair_m), np.inf), 1))
  keep = set(np.argsort(best_t, kind="stable")[:count].tolist())
  keep |= set(np.argsort(best_m, kind="stable")[:max(1, count // 4)].tolist())
  return np.array(sorted(keep))


def _milp(dt, dm, et, em, memory_room, max_actions, time_limit_s):
  """min the log serial time over x (binary per action) and y (= x_a x_b per interacting
  pair) subject to exclusions, the log memory budget and the number of actions."""
  from scipy.optimize import Bounds, LinearConstraint, milp
  n = len(dt)
  significant = np.isfinite(et) & ((np.abs(et) > NEGLIGIBLE) | (np.abs(em) > NEGLIGIBLE))
  pairs = np.argwhere(significant)
  exclusive = np.argwhere(np.triu(~np.isfinite(et), 1))
  p = len(pairs)
  c = np.concatenate([dt, et[significant]])
  mem = np.concatenate([dm, em[significant]])
  rows = []
  for k, (a, b) in enumerate(pairs):        # y <= x_a, y <= x_b, y >= x_a + x_b - 1
    rows += [((n + k, a), (1, -1), -np.inf, 0), ((n + k, b), (1, -1), -np.inf, 0),
             ((n + k, a, b), (1, -1, -1), -1, np.inf)]
  rows += [((a, b), (1, 1), -np.inf, 1) for a, b in exclusive]
  A = np.zeros((len(rows) + 2, n + p))
  lo, hi = np.empty(len(rows) + 2), np.empty(len(rows) + 2)
  for r, (cols, vals, low, high) in enumerate(rows):
    A[r, list(cols)] = vals
    lo[r], hi[r] = low, high
  A[-2, :n], lo[-2], hi[-2] = 1, 0, max_actions
  A[-1], lo[-1], hi[-1] = mem, -np.inf, memory_room
  integrality = np.concatenate([np.ones(n), np.zeros(p)])
  options = {"time_limit": time_limit_s, "disp": False}
  result = milp(c, integrality=integrality, bounds=Bounds(0, 1),
                constraints=LinearConstraint(A, lo, hi), options=options)
  if result.x is None:     # nothing fits the budget: the fastest plan, memory aside
    result = milp(c, integrality=integrality, bounds=Bounds(0, 1),
                  constraints=LinearConstraint(A[:-1], lo[:-1], hi[:-1]), options=options)
  z = np.round(result.x) if result.x is not None else np.zeros(n + p)
  return (z[:n] > 0.5, float(c @ z), float(mem @ z), result.message,
          getattr(result, "mip_gap", None), (n + p, len(A)))

"""The expert agent: plays the best of the corpus' expert strategies for the task (the generic
hand schedules for a program of no corpus family, and FSDP over its layer stack alone, which
names its parameters); where none fits, the fastest cut into micro-batches where that fits."""

from __future__ import annotations

import time
from typing import NamedTuple

from agents.search.planning import Plan, PlanningActor, cut_if_over, play
from corpus.experts import best as best_of
from corpus.experts import evaluate_experts as evaluate_schedules
from environments.protocols import SearchEnvironment
from partitioner.errors import ShardzeroError


class ExpertPlay(NamedTuple):
  """An expert strategy as the environment plays it (`corpus.experts.ExpertResult` with its
  actions and score)."""
  name: str
  schedule: str
  actions: tuple[int, ...]
  cost: object | None          # CostReport of the task's own program; None when it does not apply
  score: float | None          # env.score() after its actions
  fits: bool | None            # within the task's memory budget
  error: str | None = None


def evaluate_experts(env: SearchEnvironment) -> list[ExpertPlay]:
  """Every expert strategy of the task's model family, or the generic ones for a program of
  no corpus family (`corpus.experts.evaluate_experts`), and those naming its own parameters
  (`stack_schedules`), over the axes the task acts on, each innermost one as the model axis,
  played from `env`'s current state in a clone, costed on the task's own program. Strategies
  with an action that is not legal here are kept with the reason."""
  from corpus.registry import family_of
  from partitioner.cost import Placement
  from partitioner.tactics import parse_schedule
  played: dict[str, tuple[tuple[int, ...], float]] = {}

  def cost(schedule: str):
    trial = env.clone()
    actions = tuple(trial.action_index(str(t)) for t in parse_schedule(schedule))
    for a in actions:
      if trial.done:
        raise ShardzeroError("the episode ended before the schedule did")
      trial.step(a)
    played[schedule] = (actions, trial.score())
    return trial.exact_cost

  ctx = env.context
  inner = Placement(ctx.mesh, ctx.hardware).innermost()
  ran = evaluate_schedules(family_of(env.task.model), ctx.axes, cost, budget=ctx.budget,
                           model_axes=inner, extra=stack_schedules(ctx, inner))
  out = []
  for r in ran:
    if r.cost is None:
      out.append(ExpertPlay(r.name, r.schedule, (), None, None, None, r.error))
    else:
      actions, score = played[r.schedule]
      out.append(ExpertPlay(r.name, r.schedule, actions, r.cost, score, r.fits))
  return out


def stack_schedules(ctx, model_axes=()) -> dict[str, str]:
  """FSDP over the layer stack alone (`zero3-stack`): data parallel over every axis, and each
  weight matrix repeated in every layer (an unrolled stack's `layers/*/...` or a scanned
  stack's) tiled over the model axis along the dimension ZeRO would pick (the largest that
  divides, never the layer dimension); embeddings, the head, norms and biases stay whole.
  ZeRO-3 also gathers those: the embedding's and head's at the step's ends, where no layer's
  computation hides them, and the small ones latency-bound (DeepSpeed leaves parameters under
  `stage3_param_persistence_threshold` whole for that reason). On HF Llama and Mistral 7B at
  64-1,024 H100s, recomputed to fit, it is 4-5% faster than ZeRO-3 over the model axis. It names
  parameters, so it is built from the task's own actions (`ctx.points`), one per axis that
  may act as the model axis (the last, and the other innermost ones, named `[axis]`)."""
  from partitioner import roles as R
  from partitioner.tactics import Tile
  stacked = R.stacked_dims(ctx.program)
  axes = ctx.axes
  out = {}
  for model in dict.fromkeys((axes[-1], *(a for a in model_axes if a in axes))):
    n = ctx.mesh.sizes[model]
    if n == 1:
      continue
    tiles = []
    for p in ctx.points:
      layer = stacked.get(p.members[0])
      if p.role != "param" or (layer is None and not (len(p.members) > 1 and "*" in p.pattern)):
        continue
      dims = [d for d in range(len(p.shape)) if d != layer]
      divide = [d for d in dims if p.shape[d] % n == 0]
      if len(dims) < 2 or not divide:   # a vector (a norm's scale, a bias) stays whole
        continue
      tile = str(Tile(p.pattern, max(divide, key=lambda d: (p.shape[d], -d)), model))
      if tile in ctx.index:
        tiles.append(tile)
    if tiles:
      name = "zero3-stack" if model == axes[-1] else f"zero3-stack[{model}]"
      data = [a for a in axes if a != model]
      out[name] = "; ".join([f"BatchParallel({a})" for a in (*data, model)] + sorted(tiles))
  return out


def best_expert(results: list[ExpertPlay]) -> ExpertPlay | None:
  """The best that applies, by the one rule (`corpus.experts.preference`)."""
  return best_of(results)


class ExpertActor(PlanningActor):
  """Plays the best expert strategy (by the simulator) for each episode's task."""

  def plan(self, env: SearchEnvironment) -> Plan:
    start = time.perf_counter()
    results = evaluate_experts(env)
    best = best_expert(results)
    if best is None:
      raise ShardzeroError(f"no expert strategy applies to {env.task}: "
                           + "; ".join(f"{r.name}: {r.error}" for r in results))
    sims = sum(len(r.actions) for r in results)
    # Where the best is over the budget, it and the fastest others over it end cut into
    # micro-batches where that fits (as `agents.guard.fit_with_microbatches` cuts them).
    over = [] if best.fits else sorted((r for r in results if r.cost is not None and not r.fits),
                                       key=lambda r: r.cost.step_time_s)[:CUT_TRIES]
    lines = []
    for r in [best] + [r for r in over if r is not best]:
      line = env.clone()
      play(line, r.actions)
      cut = cut_if_over(line)
      play(line, cut)
      sims += len(cut)
      lines.append((line.score(), -len(lines), r.actions + cut, line))
    score, _, actions, line = max(lines)
    return Plan(actions + (() if line.done else (line.finish_action,)), score, sims,
                time.perf_counter() - start)


CUT_TRIES = 3   # the fastest expert plans over the budget the expert agent cuts

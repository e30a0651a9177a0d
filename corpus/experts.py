"""Expert strategies: the tactic schedules a practitioner would write for each family.

Schedules are written for a mesh whose last axis is the "model" axis (tensor, expert or
sequence parallelism, usually inside a node) and whose other axes are data axes. On a mesh
with one axis, only the strategies that need no second axis remain; on a mesh of three or
four axes, ZeRO also shards over only the innermost of them (hierarchical, as HSDP and
MaxText's data x fsdp x tensor meshes do). A program of no corpus family gets the generic
ones (`GENERIC`: data parallelism, ZeRO 1-3, HSDP, Megatron, vocabulary-parallel embeddings
and their mixtures), which apply
to any training step; where a step's layers are a scanned stack, pipelines over the outermost
axis too (`pp+dp`, and Megatron-LM's `ptd-p`). These are the reference points that search and
learned agents must match or beat, and what `propose` checks a policy's plan against.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from partitioner.errors import WorkloadError


class Strategy(NamedTuple):
  name: str
  description: str
  schedule: Callable[[Sequence[str], str], list[str]]   # (data axes, model axis) -> tactics
  two_axes: bool = True   # needs a separate model axis


def _bp(data):
  return [f"BatchParallel({a})" for a in data]


def _zero(stage):
  return lambda d, m: _bp((*d, m)) + [f"ZeRO({a}, stage={stage})" for a in (*d, m)]


def _gshard(data, model):
  """The batch split over the data axes, then the experts placed over the model axis, then the
  batch split over it too: the tokens move to their experts (`ExpertParallel` acts before the
  batch is split over its axis wherever it is written). On moe:base's 7 scales tasks this order
  is 1-7% faster than the experts placed first (cost model 15)."""
  return _bp(data) + [f"ExpertParallel({model})"] + _bp((model,))


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dp", "data parallel over every axis", lambda d, m: _bp((*d, m)), False),
    Strategy("zero1", "data parallel, optimizer state sharded (ZeRO-1)", _zero(1), False),
    Strategy("zero2", "data parallel, optimizer state and gradients sharded (ZeRO-2)",
             _zero(2), False),
    Strategy("zero3", "fully sharded data parallel (ZeRO-3 / FSDP)", _zero(3), False),
    Strategy("hsdp", "data parallel over every axis, FSDP only over the model axis (hybrid)",
             lambda d, m: _bp((*d, m)) + [f"ZeRO({m}, stage=3)"]),
    Strategy("hzero2", "data parallel over every axis, optimizer state and gradients sharded "
             "only over the model axis (hybrid ZeRO-2: reduce-scatters stay inside a node)",
             lambda d, m: _bp((*d, m)) + [f"ZeRO({m}, stage=2)"]),
    Strategy("hpz", "ZeRO++'s hierarchical partitioning (hpZ): data parallel over every axis, "
             "parameters sharded only over the model axis (their gathers stay inside a node), "
             "optimizer state and gradients over every axis (Wang et al. 2023, "
             "arXiv:2306.10209, section 3.2)",
             lambda d, m: _bp((*d, m)) + [f"ZeRO({a}, stage=2)" for a in d] + [f"ZeRO({m})"]),
    Strategy("megatron", "Megatron tensor parallel over every axis, batch replicated",
             lambda d, m: [f"Megatron({a})" for a in (*d, m)], False),
    Strategy("dp+megatron", "data parallel x Megatron tensor parallel (2D)",
             lambda d, m: _bp(d) + [f"Megatron({m})"]),
    Strategy("dp+megatron+vocab", "2D, with vocabulary-parallel embeddings",
             lambda d, m: _bp(d) + [f"Megatron({m})", f"EmbeddingSharding({m})"]),
    Strategy("dp+megatron+zero1", "2D, with the optimizer state sharded over the data axes",
             lambda d, m: _bp(d) + [f"Megatron({m})"] + [f"ZeRO({a}, stage=1)" for a in d]),
    Strategy("dp+megatron+zero3", "2D, with FSDP over the data axes",
             lambda d, m: _bp(d) + [f"Megatron({m})"] + [f"ZeRO({a}, stage=3)" for a in d]),
    Strategy("dp+sp", "data parallel x sequence (context) parallel",
             lambda d, m: _bp(d) + [f"SequenceParallel({m})"]),
    Strategy("dp+ep", "data parallel x expert parallel: experts split over the model axis",
             lambda d, m: _bp(d) + [f"ExpertParallel({m})"]),
    Strategy("dp+ep+zero3", "expert parallel with FSDP over the data axes",
             lambda d, m: _bp(d) + [f"ExpertParallel({m})"] + [f"ZeRO({a}, stage=3)" for a in d]),
    Strategy("gshard", "GShard: experts over the model axis, data parallel over every axis "
             "(tokens move to their experts)", _gshard),
    Strategy("gshard+hzero2", "GShard with optimizer state and gradients sharded over the "
             "model axis (DeepSpeed-MoE's expert parallelism with ZeRO-2)",
             lambda d, m: _gshard(d, m) + [f"ZeRO({m}, stage=2)"]),
    Strategy("pp+dp", "pipeline stages over the outermost axis (1F1B, four micro-batches a "
             "stage), data parallel over the others",
             lambda d, m: [f"Pipeline({d[0]})"] + _bp((*d[1:], m))),
    Strategy("ptd-p", "Megatron-LM's PTD-P: pipeline stages over the outermost axis, data "
             "parallel over the middle ones, Megatron tensor parallel over the model axis",
             lambda d, m: [f"Pipeline({d[0]})"] + _bp(d[1:]) + [f"Megatron({m})"]),
    Strategy("ptd-p+zero1", "PTD-P with the optimizer state sharded over the data axes "
             "(Megatron-LM's distributed optimizer)",
             lambda d, m: [f"Pipeline({d[0]})"] + _bp(d[1:]) + [f"Megatron({m})"] +
             [f"ZeRO({a}, stage=1)" for a in d[1:]]),
)}

_DATA = ("dp", "zero1", "zero2", "zero3", "hsdp", "hzero2", "hpz")
_TENSOR = ("megatron", "dp+megatron", "dp+megatron+zero1", "dp+megatron+zero3")
_VOCAB = ("dp+megatron+vocab",)
_EXPERT = ("dp+ep", "dp+ep+zero3", "gshard", "gshard+hzero2")
# Steps whose layers are a scanned stack (the others refuse in one line, before any work).
_PIPELINE = ("pp+dp", "ptd-p", "ptd-p+zero1")
# What applies to any training step: the roles (parameters, optimizer state, data) come from
# its dataflow, and Megatron finds its pairs of matmuls in any idiom (or does not apply), as
# EmbeddingSharding finds tables: a tied head left whole costs a Megatron plan the logits on
# every device (HF Gemma 2B at 64 H100s: dp+megatron 559 ms and 84 GiB, +vocab 288 ms, 37 GiB).
GENERIC = _DATA + _TENSOR + _VOCAB + _PIPELINE

# The strategies an expert would try for each family.
FAMILY_STRATEGIES: dict[str, tuple[str, ...]] = {
    "mlp": _DATA + _TENSOR,
    "gpt": _DATA + _TENSOR + _VOCAB + ("dp+sp",) + _PIPELINE,
    "bert": _DATA + _TENSOR + _VOCAB,
    "vit": _DATA + _TENSOR,
    "resnet": _DATA,
    "gnn": _DATA + _TENSOR,
    "t5": _DATA + _TENSOR + _VOCAB,
    "moe": _DATA + _TENSOR + _EXPERT,
    "vmoe": _DATA + _TENSOR + _EXPERT,
    "unet": _DATA,
    "ssm": _DATA + _TENSOR + _VOCAB,
    "hf_gpt2": _DATA + _TENSOR + _VOCAB,
    "hf_bert": _DATA + _TENSOR + _VOCAB,
    "hf_t5": _DATA + _TENSOR + _VOCAB,
    "hf_vit": _DATA + _TENSOR,
    # The external tier is measured as users' programs are served: the generic schedules.
    **{f"hf_{name}": GENERIC for name in ("llama", "mistral", "opt", "gptneo", "bart",
                                          "roberta", "bloom", "gemma")},
}


def _inner_forms(names: Sequence[str], data: tuple[str, ...], model: str) -> dict[str, str]:
  """On a mesh of three or more axes, the ZeRO strategies among `names` again with ZeRO over
  only the innermost k of the axes the full form shards (data parallel: 1 < k < all axes, as
  k = 1 is hsdp and hzero2; with Megatron: 1 <= k < all data axes): shard inside the inner
  groups, where the gathers and reduce-scatters stay on the fastest links, and replicate
  across the outer ones; hpz with its optimizer state over the model axis and the innermost
  1 <= k < all data axes. Named by the axes they shard over: `zero3(fsdp,tensor)`,
  `dp+megatron+zero3(fsdp)`, `hpz(data)`."""
  axes = (*data, model)
  out = {}
  for stage in (1, 2, 3):
    if f"zero{stage}" in names:
      for k in range(2, len(axes)):
        inner = axes[-k:]
        out[f"zero{stage}({','.join(inner)})"] = "; ".join(
            _bp(axes) + [f"ZeRO({a}, stage={stage})" for a in inner])
    if stage == 2 and "hpz" in names:
      for k in range(1, len(data)):
        inner = data[-k:]
        out[f"hpz({','.join(inner)})"] = "; ".join(
            _bp(axes) + [f"ZeRO({a}, stage=2)" for a in inner] + [f"ZeRO({model})"])
    if f"dp+megatron+zero{stage}" in names:
      for k in range(1, len(data)):
        inner = data[-k:]
        out[f"dp+megatron+zero{stage}({','.join(inner)})"] = "; ".join(
            _bp(data) + [f"Megatron({model})"] + [f"ZeRO({a}, stage={stage})" for a in inner])
  return out


def experts(family: str | None, axes: Sequence[str] = ("batch", "model"),
            model_axes: Sequence[str] | None = None) -> dict[str, str]:
  """name -> schedule text of the family's expert strategies for a mesh with these axes
  (data axes first, the model axis last); the generic ones (`GENERIC`) for family None.

  `model_axes` are the axes that may act as the model axis (default: the last one). Where
  several lie equally deep in the hardware (`Placement.innermost`: both axes of a mesh inside
  one node), each is tried, so the strategies do not depend on the order the axes are
  written in; those over another than the last are named with it, `dp+megatron[batch]`."""
  if family is not None and family not in FAMILY_STRATEGIES:
    raise WorkloadError(f"no expert strategies for {family!r}; families: "
                        f"{', '.join(FAMILY_STRATEGIES)}")
  axes = tuple(axes)
  if not axes:
    raise WorkloadError("expert strategies need a mesh with at least one axis")
  last = axes[-1]
  model_axes = [a for a in axes if a in (model_axes or ()) and a != last]
  names = GENERIC if family is None else FAMILY_STRATEGIES[family]
  out = {}
  for model in (last, *model_axes):
    data = tuple(a for a in axes if a != model)
    forms = {}
    for name in names:
      strategy = STRATEGIES[name]
      if len(axes) > 1 or not strategy.two_axes:
        # The one-axis strategies do not depend on which axis is the model axis.
        if model == last or strategy.two_axes:
          forms[name] = "; ".join(strategy.schedule(data, model))
    if len(axes) > 2:
      forms.update(_inner_forms(names, data, model))
    out.update(forms if model == last else {f"{k}[{model}]": v for k, v in forms.items()})
  return out


# --------------------------------------------------------------------------- evaluating them
class ExpertResult(NamedTuple):
  name: str
  schedule: str
  cost: Any = None              # CostReport; None when the strategy does not apply
  fits: bool | None = None      # within the memory budget
  error: str | None = None      # why it does not apply


def preference(step_time_s: float, peak_memory_bytes: float, fits: bool) -> tuple:
  """The one rule for "best" (sort ascending): what fits before what does not; among what
  fits, the fastest; among what does not, the one closest to fitting (smallest peak), then
  the fastest."""
  return (0, step_time_s, 0.0) if fits else (1, peak_memory_bytes, step_time_s)


def best(results: Sequence[ExpertResult]) -> ExpertResult | None:
  """The best of the results that apply, by `preference`."""
  ran = [r for r in results if r.cost is not None]
  return min(ran, key=lambda r: preference(r.cost.step_time_s, r.cost.peak_memory_bytes,
                                           r.fits), default=None)


def evaluate_experts(family: str | None, axes: Sequence[str], cost: Callable[[str], Any], *,
                     budget: int, strategies: Sequence[str] | None = None,
                     progress: Callable[[str], None] | None = None,
                     model_axes: Sequence[str] | None = None,
                     extra: dict[str, str] | None = None) -> list[ExpertResult]:
  """Every expert strategy of `family` (the generic ones for None) for a mesh with `axes`
  (`experts`, with `model_axes`), and the named schedules of `extra` after them, costed by
  `cost(schedule)` (a `CostReport`; a `ShardzeroError` where the strategy does not apply,
  kept with the reason) and checked against `budget` bytes per device. `progress(name)` is
  called before each."""
  from partitioner.errors import ShardzeroError
  out = []
  for name, schedule in {**experts(family, axes, model_axes), **(extra or {})}.items():
    if strategies is not None and name not in strategies:
      continue
    if progress:
      progress(name)
    try:
      report = cost(schedule)
    except ShardzeroError as e:
      out.append(ExpertResult(name, schedule, error=str(e)))
      continue
    out.append(ExpertResult(name, schedule, report, report.peak_memory_bytes <= budget))
  return out


def simulate_experts(program, mesh, hardware, family: str | None, *,
                     budget: int | None = None, order: Sequence[str] | None = None,
                     simulate: Callable | None = None, **kwargs) -> list[ExpertResult]:
  """`evaluate_experts` by the simulator: each schedule applied to `program` over `mesh` (a
  `Mesh` or "batch=8,model=4") on `hardware`, within `budget` (default the device's memory),
  with every innermost axis as a model axis. `simulate(pp)` replaces the simulator (a folded
  program's)."""
  from partitioner import apply
  from partitioner.cost import Placement, load_hardware
  from partitioner.cost import simulate as simulate_program
  from partitioner.mesh import Mesh
  mesh = mesh if isinstance(mesh, Mesh) else Mesh.parse(mesh)
  hardware = load_hardware(hardware)
  simulate = simulate or (lambda pp: simulate_program(pp, hardware, order))
  return evaluate_experts(family, mesh.names,
                          lambda schedule: simulate(apply(program, mesh, schedule)),
                          budget=budget or hardware.hbm_bytes,
                          model_axes=Placement(mesh, hardware, order).innermost(), **kwargs)

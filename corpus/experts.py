"""Expert strategies: the tactic schedules a practitioner would write for each family.

Schedules are written for a mesh whose last axis is the "model" axis (tensor, expert or
sequence parallelism, usually inside a node) and whose other axes are data axes. On a mesh
with one axis, only the strategies that need no second axis remain. These are the reference
points that search and learned agents must match or beat.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

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


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dp", "data parallel over every axis", lambda d, m: _bp((*d, m)), False),
    Strategy("zero1", "data parallel, optimizer state sharded (ZeRO-1)", _zero(1), False),
    Strategy("zero2", "data parallel, optimizer state and gradients sharded (ZeRO-2)",
             _zero(2), False),
    Strategy("zero3", "fully sharded data parallel (ZeRO-3 / FSDP)", _zero(3), False),
    Strategy("hsdp", "data parallel over every axis, FSDP only over the model axis (hybrid)",
             lambda d, m: _bp((*d, m)) + [f"ZeRO({m}, stage=3)"]),
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
    Strategy("gshard", "GShard: data parallel over every axis, experts over the model axis",
             lambda d, m: _bp((*d, m)) + [f"ExpertParallel({m})"]),
)}

_DATA = ("dp", "zero1", "zero2", "zero3", "hsdp")
_TENSOR = ("megatron", "dp+megatron", "dp+megatron+zero1", "dp+megatron+zero3")
_VOCAB = ("dp+megatron+vocab",)

# The strategies an expert would try for each family.
FAMILY_STRATEGIES: dict[str, tuple[str, ...]] = {
    "mlp": _DATA + _TENSOR,
    "gpt": _DATA + _TENSOR + _VOCAB + ("dp+sp",),
    "bert": _DATA + _TENSOR + _VOCAB,
    "vit": _DATA + _TENSOR,
    "resnet": _DATA,
    "gnn": _DATA + _TENSOR,
    "t5": _DATA + _TENSOR + _VOCAB,
    "moe": _DATA + _TENSOR + ("dp+ep", "dp+ep+zero3", "gshard"),
    "unet": _DATA,
    "ssm": _DATA + _TENSOR + _VOCAB,
    "hf_gpt2": _DATA + _TENSOR + _VOCAB,
    "hf_bert": _DATA + _TENSOR + _VOCAB,
    "hf_t5": _DATA + _TENSOR + _VOCAB,
    "hf_vit": _DATA + _TENSOR,
}


def experts(family: str, axes: Sequence[str] = ("batch", "model")) -> dict[str, str]:
  """name -> schedule text of the family's expert strategies for a mesh with these axes
  (data axes first, the model axis last)."""
  if family not in FAMILY_STRATEGIES:
    raise WorkloadError(f"no expert strategies for {family!r}; families: "
                        f"{', '.join(FAMILY_STRATEGIES)}")
  axes = tuple(axes)
  if not axes:
    raise WorkloadError("expert strategies need a mesh with at least one axis")
  out = {}
  for name in FAMILY_STRATEGIES[family]:
    strategy = STRATEGIES[name]
    if len(axes) > 1 or not strategy.two_axes:
      out[name] = "; ".join(strategy.schedule(axes[:-1], axes[-1]))
  return out

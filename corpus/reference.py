"""The reference table: every expert strategy of every corpus model, simulated on one mesh and
hardware. Search and learned agents are judged against its best entry per model."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from corpus.experts import preference, simulate_experts
from corpus.registry import load, parse
from corpus.workload import parameter_count

# Realistic sizes for the table, per family.
TABLE_MODELS = ("mlp:large", "gpt:1.3b", "gpt:6.7b", "bert:large", "vit:large", "resnet:50",
                "gnn:base", "t5:large", "moe:base", "unet:base", "ssm:base",
                # the real-models tier at published sizes
                "hf_gpt2:124m", "hf_bert:large", "hf_t5:220m", "hf_vit:base")


class Entry(NamedTuple):
  model: str
  family: str
  parameters: int
  strategy: str
  schedule: str
  step_time_s: float | None     # None when the strategy does not apply
  compute_s: float | None
  comm_s: float | None
  exposed_comm_s: float | None
  peak_memory_bytes: int | None
  fits: bool | None
  error: str | None = None      # why the strategy does not apply to this model and mesh
  best: bool = False            # the fastest strategy that fits, per model

  def to_dict(self) -> dict:
    return self._asdict()


def evaluate_model(spec: str, mesh, hardware, order: Sequence[str] | None = None,
                   strategies: Sequence[str] | None = None,
                   progress: Callable[[str], None] | None = None) -> list[Entry]:
  """Every expert strategy of one model on `mesh` (a `Mesh` or "batch=8,model=4")."""
  from partitioner import trace
  family, _ = parse(spec)
  workload = load(spec, abstract=True)
  program = trace(workload.fn, *workload.args)
  n_params = parameter_count(workload.args[0])
  results = simulate_experts(program, mesh, hardware, family.name, order=order,
                             strategies=strategies,
                             progress=progress and (lambda name: progress(f"{spec} {name}")))
  entries = []
  for r in results:
    c = r.cost
    entries.append(Entry(spec, family.name, n_params, r.name, r.schedule,
                         *((c.step_time_s, c.compute_s, c.comm_s, c.exposed_comm_s,
                            c.peak_memory_bytes, r.fits) if c is not None else (None,) * 6),
                         r.error))
  return mark_best(entries)


def mark_best(entries: list[Entry]) -> list[Entry]:
  """Marks, per model, its best strategy (`corpus.experts.preference`)."""
  out = list(entries)
  for model in dict.fromkeys(e.model for e in entries):
    ran = [i for i, e in enumerate(out) if e.model == model and e.step_time_s is not None]
    if ran:
      i = min(ran, key=lambda i: preference(out[i].step_time_s, out[i].peak_memory_bytes,
                                            out[i].fits))
      out[i] = out[i]._replace(best=True)
  return out


def best(entries: Sequence[Entry], model: str) -> Entry | None:
  return next((e for e in entries if e.model == model and e.best), None)


def reference_table(models: Sequence[str] = TABLE_MODELS, mesh="batch=8,model=4",
                    hardware="tpu-v4", order=None, progress=None) -> list[Entry]:
  """`evaluate_model` for each model; `progress(label)` is called before each strategy."""
  for spec in models:
    parse(spec)  # fail on a bad name before any work
  out = []
  for spec in models:
    out.extend(evaluate_model(spec, mesh, hardware, order, progress=progress))
  return out


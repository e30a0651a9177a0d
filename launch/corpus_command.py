"""`shardzero corpus`: the model corpus, and the reference table of expert strategies."""

from __future__ import annotations

import argparse

from launch import report

HELP = "list the model corpus; --table simulates every expert strategy of every model"

DESCRIPTION = """\
Without options, list the corpus: each model family with its split (train: for learning;
heldout: for evaluation only), presets and knobs. Any family accepts knobs after its name:
gpt:layers=24,d_model=2048 or gpt:1.3b,batch=32.

--table traces each model at a realistic size, applies every expert strategy of its family
(data parallel, ZeRO-1/2/3, hybrid FSDP, Megatron, 2D, sequence and expert parallel), and
prints each one's predicted step time, memory per device and whether it fits on --hardware,
marking the best strategy that fits (*). These are the reference numbers that search and
learned agents must match; --json writes them for the evaluation code. The mesh's last axis
is the model axis (tensor/expert/sequence parallelism); the others are data axes.
"""

EXAMPLES = """\
examples:
  shardzero corpus
  shardzero corpus --split heldout --json -
  shardzero corpus --table --mesh batch=8,model=4 --hardware tpu-v4
  shardzero corpus --table --mesh batch=32,model=8 --global-batch 512 --json table.json
  shardzero corpus --table --models "gpt:1.3b;gpt:layers=8,d_model=1024" --mesh batch=4,model=2
"""


def add_parser(sub) -> None:
  p = sub.add_parser("corpus", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--split", choices=("train", "heldout", "real", "external"),
                 help="only the families of a split (real: HuggingFace Flax models; external: "
                 "more of them, never trained on)")
  p.add_argument("--table", action="store_true",
                 help="simulate every expert strategy of each model (see --models)")
  p.add_argument("--models", metavar="SPECS",
                 help="comma-separated models for --table; ';' also separates, so knobs stay "
                      "intact: 'gpt:1.3b;gpt:layers=8,d_model=1024' (default: one or two "
                      "realistic sizes per family)")
  p.add_argument("--mesh", default="batch=8,model=4", help="mesh for --table "
                 "(default batch=8,model=4)")
  p.add_argument("--global-batch", type=int, metavar="N",
                 help="set every model's batch knob to N (scale it with the mesh: data "
                      "parallelism over 256 devices needs a batch that divides by 256)")
  p.add_argument("--hardware", default="tpu-v4", help="hardware for --table (default tpu-v4)")
  p.add_argument("--order", metavar="AXES", help="mesh axes major to minor in device numbering")
  p.add_argument("--json", metavar="PATH", help="write JSON to PATH ('-': stdout)")
  p.set_defaults(run=run)


def split_models(text: str) -> list[str]:
  """'gpt:1.3b,gpt:6.7b' or 'gpt:1.3b;gpt:layers=8,d_model=1024' -> specs."""
  if ";" in text:
    return [s.strip() for s in text.split(";") if s.strip()]
  out = []
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    if out and ":" not in part and "=" in part:
      out[-1] += "," + part   # a knob of the previous model
    else:
      out.append(part)
  return out


def run(args) -> int:
  if args.table:
    return _table(args)
  from corpus import FAMILIES
  from corpus.experts import STRATEGIES, experts
  import dataclasses
  families = [f for f in FAMILIES.values() if args.split in (None, f.split)]
  if args.json:
    report.write_json({f.name: {
        "split": f.split, "description": f.description, "presets": list(f.presets),
        "knobs": {k.name: getattr(f.presets[f.default], k.name)
                  for k in dataclasses.fields(f.presets[f.default])},
        "experts": {name: {"schedule": schedule, "description": STRATEGIES[name].description}
                    for name, schedule in experts(f.name).items()}} for f in families},
        args.json)
    if args.json == "-":
      return 0
  rows = [(f.name, f.split, ", ".join(f.presets), ", ".join(experts(f.name)), f.description)
          for f in families]
  report.console().print(report.table("model corpus", ["family", "split", "presets",
                                                       "expert strategies", "what"], rows))
  return 0


def _table(args) -> int:
  from rich.progress import Progress
  from corpus import reference
  from partitioner.cost import Placement, load_hardware
  from partitioner.errors import WorkloadError
  from partitioner.mesh import Mesh
  mesh = Mesh.parse(args.mesh)
  hardware = load_hardware(args.hardware)
  order = tuple(a.strip() for a in args.order.split(",")) if args.order else None
  Placement(mesh, hardware, order)
  models = split_models(args.models) if args.models else list(reference.TABLE_MODELS)
  if args.global_batch is not None:
    if args.global_batch < 1:
      raise WorkloadError(f"--global-batch must be positive, got {args.global_batch}")
    models = [f"{m}{',' if ':' in m else ':'}batch={args.global_batch}" for m in models]
  with Progress(transient=True, disable=args.json == "-") as progress:
    task = progress.add_task("strategies", total=None)
    entries = reference.reference_table(
        models, mesh, hardware, order,
        progress=lambda label: progress.update(task, description=label, advance=1))
  if args.json:
    report.write_json({"mesh": args.mesh, "hardware": hardware.name, "order": order,
                       "entries": [e.to_dict() for e in entries]}, args.json)
    if args.json == "-":
      return 0
  rows = []
  for e in entries:
    if e.step_time_s is None:
      rows.append((e.model, "  " + e.strategy, "-", "-", "-", "-", f"n/a: {e.error}"))
      continue
    rows.append((e.model, ("* " if e.best else "  ") + e.strategy, f"{e.step_time_s * 1e3:.1f}",
                 f"{e.compute_s * 1e3:.1f}", f"{e.exposed_comm_s * 1e3:.1f}",
                 report.human_bytes(e.peak_memory_bytes), "yes" if e.fits else "NO"))
  report.console().print(report.table(
      f"expert strategies on {args.mesh} x {hardware.name} (* best that fits)",
      ["model", "strategy", "step ms", "compute ms", "exposed comm ms", "memory/device",
       "fits"], rows, justify={2: "right", 3: "right", 4: "right", 5: "right"}))
  return 0

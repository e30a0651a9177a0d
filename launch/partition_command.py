"""`shardzero partition MODEL --mesh ... --tactics ...`: apply a manual strategy and show it."""

from __future__ import annotations

import argparse
import time

from launch import report

HELP = "partition a model with a tactic schedule; show shardings and collectives"

DESCRIPTION = """\
Trace MODEL's training step, apply a schedule of tactics over a device mesh, and print the
per-input shardings, the collectives the partitioner inserted, any ops that fell back to
replication, conflicts between tactics, and the predicted step time and memory per device on
--hardware. --verify runs the explicit shard_map program and the jax.jit program on local
devices against the unpartitioned program. Meshes of thousands of devices are fine: only
--verify and --xla need real devices.

MODEL is a corpus entry (mlp:small, gpt:small, gpt:layers=24,d_model=2048) or
package.module:function / path/to/file.py:function returning (fn, example_args).

Tactics (separated by ';'):
  BatchParallel(AXIS)            split the batch inputs over AXIS
  Megatron(AXIS)                 tensor-parallel MLPs (column/row) and attention heads
  ZeRO(AXIS, stage=1|2|3)        shard optimizer state / gradients / parameters over AXIS
  EmbeddingSharding(AXIS)        split embedding tables along the vocabulary
  Tile(PATTERN, DIM, AXIS)       tile matching inputs (globs: params/**/w_in/w)
  ExpertParallel(AXIS)           split expert weights along the expert dimension (acts
                                 before what splits the batch over AXIS: tokens move)
  SequenceParallel(AXIS[, DIM])  split the batch inputs along the sequence dimension
  Replicate(PATTERN[, AXES])     keep matching inputs replicated
  Auto(AXES[, agent=greedy|beam|mcts|random|ilp, budget=N, policy=RUN_DIR, hardware=HW,
       memory=BYTES])            let a search agent or a trained policy ('shardzero train'
                                 run) choose tactics over AXES (model, batch+model)
  Microbatch(K)                  gradient accumulation: the batch cut into K micro-batches
                                 run in a loop (first in the schedule; activations shrink)
  Pipeline(AXIS[, stages=S, microbatches=M, schedule=1f1b|gpipe|interleaved, virtual=V])
                                 pipeline stages of a scanned layer stack over AXIS (one
                                 per device; M micro-batches, 4 a stage by default;
                                 interleaved: V chunks of layers a stage; first in the
                                 schedule)
  HeadPadding(AXIS)              pad attention heads that AXIS does not divide (12 over
                                 8) with zero heads, so Megatron splits them (first in the
                                 schedule; before Microbatch)
  Remat()                        recompute activations in the backward pass from the
                                 values at the forward pass's narrowest cuts (the residual
                                 stream), as jax.checkpoint per layer (first; before
                                 Microbatch)
  StageScatter(AXIS)             split a pipeline's hand-overs and kept activations over
                                 AXIS (Megatron-LM's scatter/gather; after Megatron)
"""

EXAMPLES = """\
examples:
  shardzero partition gpt:small --mesh batch=2,model=4 \\
      --tactics "BatchParallel(batch); Megatron(model)" --verify
  shardzero partition mlp:small --mesh batch=8 --tactics "ZeRO(batch, stage=3)" --json -
  shardzero partition t5:mini --mesh batch=4,model=2 \\
      --tactics "BatchParallel(batch); Auto(model, agent=mcts, budget=50)"
  shardzero partition gpt:mini --mesh batch=2,model=4 \\
      --tactics "Microbatch(4); BatchParallel(batch); Megatron(model)"
  shardzero partition gpt:small,scan=true --mesh pipe=2,batch=2,model=2 \\
      --tactics "Pipeline(pipe, microbatches=4); BatchParallel(batch); Megatron(model)" --verify
  shardzero partition "hf_bert:small,heads=6,d_model=96" --mesh batch=2,model=4 \\
      --tactics "HeadPadding(model); BatchParallel(batch); Megatron(model)" --verify
  shardzero partition hf_gpt2:small --mesh batch=2,model=4 \\
      --tactics "Remat(); BatchParallel(batch); ZeRO(model)" --verify
"""


def add_parser(sub) -> None:
  p = sub.add_parser("partition", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="corpus name or module:function / path.py:function")
  p.add_argument("--mesh", required=True, help="named mesh axes, e.g. batch=4,model=2")
  p.add_argument("--tactics", required=True, help="tactic schedule, e.g. "
                 "'BatchParallel(batch); Megatron(model); ZeRO(batch, stage=3)'")
  p.add_argument("--hardware", default="h100",
                 help="catalog name (see 'shardzero hardware') or a YAML/JSON spec file; "
                      "default h100")
  p.add_argument("--order", metavar="AXES",
                 help="mesh axes from major to minor in device numbering, e.g. model,batch "
                      "(default: the mesh's order; minor axes fill a node first)")
  p.add_argument("--verify", action="store_true",
                 help="run both lowerings on local devices and compare with the unpartitioned "
                      "program")
  p.add_argument("--xla", action="store_true",
                 help="also compile the jax.jit program and list XLA's collectives beside the "
                      "partitioner's")
  p.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout, "
                 "instead of the tables)")
  p.add_argument("--all", action="store_true",
                 help="list every input and conflict instead of folding repeated layers")
  p.add_argument("--loops", choices=("auto", "unroll", "keep"), default="auto",
                 help="lax.scan loops: unrolled into straight-line code, or kept as loops whose "
                      "body is partitioned once and run every iteration (auto: loops of more "
                      "than 4 iterations are kept)")
  p.set_defaults(run=run, host_devices=lambda: _mesh_size(p))


def _mesh_size(parser) -> int:
  """Devices to create: the mesh's size when it will run (--verify, --xla), else 8."""
  import sys
  from partitioner.mesh import Mesh
  argv = sys.argv
  if "--verify" not in argv and "--xla" not in argv:
    return 8
  for i, a in enumerate(argv):
    text = argv[i + 1] if a == "--mesh" and i + 1 < len(argv) else (
        a.split("=", 1)[1] if a.startswith("--mesh=") else None)
    if text:
      try:
        return Mesh.parse(text).device_count
      except Exception:
        return 8
  return 8


def run(args) -> int:
  import corpus
  import partitioner
  from partitioner.partition import as_mesh

  from partitioner.cost import Placement, load_hardware, simulate

  mesh = as_mesh(args.mesh)
  schedule = partitioner.parse_schedule(args.tactics)
  hardware = load_hardware(args.hardware)
  order = tuple(a.strip() for a in args.order.split(",")) if args.order else None
  Placement(mesh, hardware, order)  # checks the order before the work starts
  t0 = time.perf_counter()
  workload = corpus.load(args.model)
  t1 = time.perf_counter()
  program = partitioner.trace(workload.fn, *workload.args, loops=args.loops)
  t2 = time.perf_counter()
  solver = None
  if any(isinstance(t, partitioner.Auto) for t in schedule):
    from launch.auto import solve as solver
  pp = partitioner.apply(program, mesh, schedule, solver)
  pp.plan  # derived here so that the partition time includes it
  t3 = time.perf_counter()
  cost = simulate(pp, hardware, order)
  t4 = time.perf_counter()
  result = {"model": args.model, **pp.summary(), "cost": cost.to_dict(),
            "timing_s": {"build": t1 - t0, "trace": t2 - t1, "partition": t3 - t2,
                         "simulate": t4 - t3}}
  verification = None
  if args.verify:
    from partitioner.verify import verify
    verification = verify(pp, workload.args)
    result.update(verified=verification.ok, max_abs_err=verification.max_abs_err,
                  errors=verification.errors)
  xla = None
  if args.xla:
    from partitioner.hlo import hlo_collectives
    text = pp.jit().lower(*workload.args).compile().as_text()
    xla = hlo_collectives(text, pp.mesh)
    result["xla_collectives"] = [c._asdict() for c in xla]
  if args.json:
    report.write_json(result, args.json)
    if args.json == "-":
      return 0 if verification is None or verification.ok else 1
  _print(args, pp, result, verification, xla, cost)
  return 0 if verification is None or verification.ok else 1


def _side_by_side(pp, xla):
  """Rows (kind, axes, plan count, plan bytes, XLA count, XLA bytes) for every pair seen."""
  rows: dict = {}
  for c in pp.collectives:
    r = rows.setdefault((c.kind, c.axes), [0, 0, 0, 0])
    r[0] += 1
    r[1] += c.bytes
  for c in xla:
    if not c.from_constant:
      r = rows.setdefault((c.kind, c.axes), [0, 0, 0, 0])
      r[2] += c.count
      r[3] += c.bytes
  return [(k, "+".join(a), p, report.human_bytes(pb), x, report.human_bytes(xb))
          for (k, a), (p, pb, x, xb) in sorted(rows.items())]


def _print_cost(out, cost) -> None:
  h = report.human_bytes
  ms = lambda s: f"{s * 1e3:.2f} ms"
  layout = ", ".join(f"{a}: {level}" for a, level in cost.placement.items())
  out.print(f"predicted on {cost.hardware} ({layout}): step {ms(cost.step_time_s)} = compute "
            f"{ms(cost.compute_s)} + exposed communication {ms(cost.exposed_comm_s)} "
            f"({ms(cost.comm_s)} of collectives in all)")
  m = cost.memory
  status = "[green]fits[/green]" if m.fits else "[red]does not fit[/red]"
  parts = ", ".join(f"{k.replace('_', ' ')} {h(v)}" for k, v in m.breakdown.items())
  out.print(f"memory per device: peak {h(m.peak_bytes)} of {h(m.capacity_bytes)}, {status} "
            f"(at the peak: {parts})")
  rows = [(d["kind"], "+".join(d["axes"]), d["decomposition"], d["count"],
           f"{d['step_launches']:.0f}", h(d["step_bytes"]), ms(d["step_seconds"]),
           ms(d["exposed_seconds"])) for d in cost.decompositions()]
  if rows:   # launches: fewer than tensors where the combiner joins them
    out.print(report.table("collective time per device and step (a loop's collectives count "
                           "every iteration)", ["kind", "axes", "run as", "tensors", "launches",
                                                "bytes", "time", "exposed"], rows,
                           justify={k: "right" for k in range(3, 8)}))


def layout_lines(program) -> list[str]:
  """What the program holds in another layout than the user's (partitioner/layouts.py)."""
  groups: dict = {}
  for k, lay in program.layouts.items():
    groups.setdefault(str(lay), []).append(program.input_names[k])
  return (["held in another layout, so that they split (inputs converted once as they are "
           "placed, `Program.store_inputs`; outputs converted back):"] +
          [f"  {text}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
           for text, names in groups.items()]) if groups else []


def _print(args, pp, result, verification, xla, cost) -> None:
  from partitioner.collectives import summarize
  out = report.console()
  p = pp.program
  out.print(f"[bold]{args.model}[/bold]: {p.num_ops} ops, {len(p.inputs)} inputs; "
            f"mesh {pp.mesh} ({pp.mesh.device_count} devices)")
  if p.loops:
    unrolled = [l for l in p.loops if l["unrolled"]]
    kept = len(p.loops) - len(unrolled)
    out.print(f"loops: {len(unrolled)} scan(s) unrolled when traced"
              + (f" ({', '.join(sorted({str(l['length']) + ' steps' for l in unrolled}))})"
                 if unrolled else "")
              + (f", {kept} kept as loops (body partitioned once, run "
                 f"{', '.join(str(r.length) for r in p.regions)} times)" if kept else ""))
  for line in layout_lines(p):
    out.print(line)
  out.print(f"strategy: {pp.strategy}")
  for r in pp.reports:
    out.print(f"  {r.tactic}: {len(r.targets)} values tiled, {r.visits} op visits"
              + "".join(f"\n    note: {n}" for n in r.notes))
  rows = [(n, tuple(p.values[v].shape), str(pp.state.sharding(v)))
          for v, n in zip(p.inputs, p.input_names)]
  grouped = [(n, s, sh, 1) for n, s, sh in rows] if args.all else report.group_rows(rows)
  out.print()
  out.print(report.table("input shardings", ["input", "shape", "sharding", "count"],
                         [(n, "x".join(map(str, s)) or "scalar", sh, c if c > 1 else "")
                          for n, s, sh, c in grouped]))
  out.print()
  groups = summarize(pp.collectives)
  if groups:
    out.print(report.table("collectives per device", ["kind", "axes", "count", "bytes"],
                           [(g["kind"], "+".join(g["axes"]), g["count"],
                             report.human_bytes(g["bytes"])) for g in groups],
                           justify={2: "right", 3: "right"}))
  else:
    out.print("collectives: none")
  held = pp.plan.held
  if held.values:
    loops = sum(len(ks) for ks in held.carries.values())
    n = loops + sum(1 for j in held.ops if p.ops[j].outputs[0] not in held.values)
    out.print(f"partial sums deferred: {len(held.leaves)} partial results carried through linear "
              f"ops and reduced by {n} all-reduce{'s' if n > 1 else ''} where they meet"
              + (f" ({loops} after a loop instead of in every iteration)" if loops else ""))
  if xla is not None:
    out.print()
    out.print(report.table("collectives: partitioner vs XLA (jax.jit)",
                           ["kind", "axes", "plan", "plan bytes", "XLA", "XLA bytes"],
                           _side_by_side(pp, xla),
                           justify={2: "right", 3: "right", 4: "right", 5: "right"}))
    constant = sum(c.bytes for c in xla if c.from_constant)
    if constant:
      out.print(f"  (XLA also moves {report.human_bytes(constant)} of broadcast constants, "
                "which carry no data; not listed)")
  if pp.fallbacks:
    out.print()
    out.print(report.table("ops that run replicated (no sharding rule)", ["op", "primitive", "why"],
                           [(f"#{i}", p.ops[i].name, r) for i, r in pp.fallbacks.items()]))
  if pp.conflicts:
    shown = pp.conflicts if args.all else pp.conflicts[:5]
    out.print(f"\n{len(pp.conflicts)} conflicts resolved by resharding"
              + ("" if args.all or len(pp.conflicts) <= 5 else " (first 5; --all for every one)")
              + ":")
    for c in shown:
      out.print(f"  {c}")
  out.print()
  _print_cost(out, cost)
  t = result["timing_s"]
  out.print(f"\ntrace {t['trace']*1e3:.0f} ms, partition {t['partition']*1e3:.0f} ms, "
            f"simulate {t['simulate']*1e3:.0f} ms")
  if verification is not None:
    status = "[green]OK[/green]" if verification.ok else "[red]MISMATCH[/red]"
    errs = ", ".join(f"{k} {v:.2e}" for k, v in verification.errors.items())
    out.print(f"verify: {status} (max abs error {errs}; rtol {verification.rtol}, "
              f"atol {verification.atol}" + (f"; worst output {verification.worst}"
                                             if not verification.ok else "") + ")")

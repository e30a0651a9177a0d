"""`shardzero hardware`: the hardware catalog, or one spec as a template for your own."""

from __future__ import annotations

import argparse

from launch import report

HELP = "list the hardware catalog, or show one spec as YAML"

DESCRIPTION = """\
List the accelerators the cost model knows (peak FLOP/s, memory, interconnect), or print one
spec with --show NAME as YAML: save it, edit it, and pass the file to --hardware to describe
your own machine. Bandwidths are bytes/s per device in one direction; latencies are seconds
per collective step; node_size devices share the fast (intra) link; kernel_launch_s is what
each kernel launch adds to its roofline time (4 us on the GPUs, fitted to H100 traces; 0 where
not measured).
"""


def add_parser(sub) -> None:
  p = sub.add_parser("hardware", help=HELP, description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--show", metavar="NAME|FILE", help="print one spec as YAML")
  p.add_argument("--json", metavar="PATH", help="write the catalog as JSON ('-': stdout)")
  p.set_defaults(run=run)


def run(args) -> int:
  from partitioner.cost import CATALOG, load_hardware
  if args.show:
    import yaml
    print(yaml.safe_dump(load_hardware(args.show).to_dict(), sort_keys=False), end="")
    return 0
  if args.json:
    report.write_json({name: h.to_dict() for name, h in CATALOG.items()}, args.json)
    if args.json == "-":
      return 0
  tf = lambda x: f"{x / 1e12:.0f}" if x >= 1e12 else f"{x / 1e12:.2f}"
  gbs = lambda x: f"{x / 1e9:.0f} GB/s"
  rows = [(h.name, tf(h.flops("bfloat16")), tf(h.flops("float32")),
           report.human_bytes(h.hbm_bytes), gbs(h.hbm_bandwidth), h.node_size,
           f"{h.intra.name} {gbs(h.intra.bandwidth)}", f"{h.inter.name} {gbs(h.inter.bandwidth)}",
           f"{h.kernel_launch_s * 1e6:g} us")
          for h in CATALOG.values()]
  out = report.console()
  out.print(report.table("hardware catalog (per device)",
                         ["name", "bf16 TFLOP/s", "f32 TFLOP/s", "HBM", "HBM bandwidth", "node",
                          "intra-node", "inter-node", "launch"], rows))
  return 0

"""`shardzero`: the command line. Arguments are parsed before JAX starts, so the number of
host devices can be set from the mesh; bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys

from launch import (convert_command, corpus_command, evaluate_command, export_command,
                    hardware_command, partition_command, plot_command, propose_command,
                    search_command, train_command)

COMMANDS = (partition_command, search_command, train_command, propose_command, evaluate_command,
            plot_command, corpus_command, hardware_command, export_command, convert_command)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="shardzero",
      description="Partition JAX training steps over a device mesh with tactics "
                  "(PartIR-style), predict their cost, and learn to choose them.",
      epilog="Run 'shardzero COMMAND --help' for the options of a command.")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for command in COMMANDS:
    command.add_parser(sub)
  return parser


def ensure_host_devices(count: int) -> None:
  """Ask XLA for `count` CPU devices (for --verify) unless the user chose a number."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  devices = getattr(args, "host_devices", None)
  ensure_host_devices(max(8, devices() if callable(devices) else 8))
  from launch.runtime import compilation_cache, relax_gc
  from partitioner.errors import ShardzeroError
  relax_gc()
  compilation_cache()
  try:
    return args.run(args) or 0
  except ShardzeroError as e:
    print(f"shardzero {args.command}: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:
    return 0


if __name__ == "__main__":
  sys.exit(main())

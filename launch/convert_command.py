"""`shardzero convert-checkpoint`: a pickled checkpoint of an earlier shardzero to the safe
format (learners/checkpointing.py)."""

from __future__ import annotations

import argparse

HELP = "convert a pickled checkpoint of an earlier shardzero (only one you trust)"

DESCRIPTION = """\
Checkpoints of shardzero before the safe format were pickles. Loading a pickle runs whatever
code its author put in it, so 'propose', 'train --resume' and 'evaluate' refuse them. This
command unpickles one and writes it as checkpoint.ckpt beside it (arrays in an .npz, the
structure in JSON: nothing in the new file can run code). Run it only on a checkpoint you made
yourself or whose source you trust.
"""


def add_parser(sub) -> None:
  p = sub.add_parser("convert-checkpoint", help=HELP, description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("path", help="a run directory or its checkpoint.pkl")
  p.set_defaults(run=run)


def run(args) -> int:
  from learners import checkpointing
  out = checkpointing.convert_pickled(args.path)
  print(f"wrote {out}; the pickled file is left as it was (delete it once you are done)")
  return 0

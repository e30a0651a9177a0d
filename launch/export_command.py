"""`shardzero export-policy RUN_DIR OUT_DIR`: a trained policy as it is shipped."""

from __future__ import annotations

import argparse

HELP = "write a run's policy, and only what playing it needs, to a directory"

DESCRIPTION = """\
Copies the policy of a 'shardzero train' run directory to OUT_DIR as 'propose --policy',
'evaluate' and 'Auto(policy=...)' load it: the run's config and a checkpoint of the parameters
it plays (the moving average where the learner kept one) and their version, in the safe
checkpoint format. The learner's optimizer state and logs stay behind, so the result is a few
hundred kB: how policies/default, the policy shardzero ships, is made.
"""

EXAMPLES = """\
examples:
  shardzero export-policy runs/policy-seed0 policies/default
"""


def add_parser(sub) -> None:
  p = sub.add_parser("export-policy", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", help="a training run directory")
  p.add_argument("out_dir", help="where to write the policy (created if missing)")
  p.set_defaults(run=run)


def run(args) -> int:
  import os
  from learners.checkpointing import FILENAME
  from learners.policies import export_policy
  policy = export_policy(args.run_dir, args.out_dir)
  size = os.path.getsize(os.path.join(args.out_dir, FILENAME))
  print(f"wrote {args.out_dir}: the policy of {args.run_dir} at version {policy.version} "
        f"({size / 1024:.0f} KiB)")
  return 0

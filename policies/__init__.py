"""The policy shipped with shardzero: `policies/default`, a `shardzero train` run directory in
the safe checkpoint format (`learners.checkpointing`), which `propose` uses when no --policy is
given. `policies/default/README.md` says how it was trained; `make policy` trains it again."""

import os

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default")

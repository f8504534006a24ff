"""`python -m rollout.eval`: the same as the `rollout-eval` command."""

import sys

from rollout.eval.cli import main

sys.exit(main())

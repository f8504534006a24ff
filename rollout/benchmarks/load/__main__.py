"""`python -m rollout.benchmarks.load`: the standalone entry point (`rollout-bench load` is the usual one)."""

import sys

from rollout.benchmarks.load import main

if __name__ == "__main__":
    sys.exit(main())

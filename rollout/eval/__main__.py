"""`python -m rollout.eval`: the same as the `rollout-eval` command."""

from rollout.eval.cli import console_main

console_main()

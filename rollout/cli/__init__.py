"""What every console script (rollout-worker, rollout-bench, rollout-eval, rollout-keygen) shares outside its
engine, in the order a command line passes through it:

- `parser.py`: `CliParser`, the argparse parser of every script: one-line flag errors with the closest flag
  suggested, every default in `--help`, `ROLLOUT_<FLAG>` defaults, a `FieldError` named by its flag;
- `batch_config_flags.py`: `--batch-config KEY=VALUE ...` read into a `ContinuousBatchingConfig`;
- `device_names.py`: `--device` checked by name (cpu, cuda or cuda:N) before torch loads;
- `extras.py`: the optional extras, and the one-line error naming the pip command when a feature's extra is missing;
- `hub.py`: a model or dataset id checked against a hub the machine may not reach, before it loads;
- `interrupts.py`: Ctrl-C while a command imports torch or loads a model, reported in one line;
- `process_exit.py`: the process ends as soon as its command is done, without the interpreter's teardown.

Nothing here imports torch; importing this package imports none of its modules.
"""

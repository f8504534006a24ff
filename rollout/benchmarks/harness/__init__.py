"""What every benchmark runs on (the subcommands' folders import these, never the other way round):

- `choices.py`: the names and numbers the parser offers, free of torch;
- `workloads.py`: the throughput workloads' model shapes, prompts and output lengths;
- `section_run.py`: a command run in its own process group with a timeout, its output teed; `isolated.py`: one
  benchmarked system run that way, its result one JSON line; `pytest_outcomes.py`: a pytest plugin writing each
  test's outcome as it finishes, so a test section cut at its limit keeps its counts;
- `worker_probe.py`: a free port for a benchmark's `rollout-worker` subprocess, and waiting until it answers;
- `stub_model.py`: a model whose forward is stubbed (host-time and long-tail benchmarks);
- `progress.py`: progress lines on stderr.
"""

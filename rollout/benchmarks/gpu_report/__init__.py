"""`rollout-bench gpu-report`: every GPU figure and the GPU tests in one run, in the order a run goes:

- `plan.py`: `--plan`, the device calls that fit one GPU window;
- `sections.py`: the sections, headline first, each run in its own process group
  (`rollout.benchmarks.harness.section_run`);
- `figures.py`: a section's result, goals and rows (`throughput_rows.py`: the throughput sections' rows);
- `table.py`: the markdown table; `report.py`: the subcommand.
"""

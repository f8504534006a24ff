"""Ctrl-C while `rollout-eval` scores: a slow `--metric module:function` (a judge model, tests run per sample) spends
minutes after generation, and Ctrl-C there lost every generated row (exit 130, no --output written), where Ctrl-C
while generating or comparing, and a metric that fails, keep them. The rows are now written, unscored, and the
message says where; they are the rows an uninterrupted run writes, less `correct`."""

from __future__ import annotations

import json
from pathlib import Path

from rollout.eval.cli import main

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"
FLAGS = ["--model", "tiny", "--dataset", str(REPO_DATASET), "--prompt-field", "question", "--answer-field", "answer"]

# A metric that scores three rows, then meets Ctrl-C (KeyboardInterrupt is what SIGINT raises in the main thread).
METRIC = """
CALLS = []

def judge(completion, answer):
    CALLS.append(completion)
    if len(CALLS) == 4:
        raise KeyboardInterrupt
    return False
"""


def test_ctrl_c_while_scoring_keeps_the_generated_rows(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow_judge.py").write_text(METRIC)
    complete, interrupted = tmp_path / "complete.jsonl", tmp_path / "interrupted.jsonl"
    assert main([*FLAGS, "--max-new-tokens", "3", "--output", str(complete)]) == 0
    capsys.readouterr()
    (tmp_path / "interrupted.jsonl.summary.json").write_text("{}")  # an earlier run's
    status = main([*FLAGS, "--max-new-tokens", "3", "--metric", "slow_judge:judge", "--output", str(interrupted)])
    assert status == 130
    err = capsys.readouterr().err
    assert f"rollout-eval: interrupted while scoring; the rows, unscored, are in {interrupted}" in err
    rows = [json.loads(line) for line in interrupted.read_text().splitlines()]
    expected = [
        {k: v for k, v in json.loads(line).items() if k != "correct"} for line in complete.read_text().splitlines()
    ]
    assert len(rows) == 12 and rows == expected
    assert not (tmp_path / "interrupted.jsonl.summary.json").exists()

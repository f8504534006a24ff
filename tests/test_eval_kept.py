"""`rollout-eval` keeps what it computed and reads files as editors write them: the finished samples' rows when the
engine fails some samples or Ctrl-C stops the generation (checked against transformers' greedy `generate`), no earlier
run's summary beside rows that have none, a UTF-8 byte order mark or an indented JSON array read as the plain file,
and a CSV header naming a field twice refused by name (a dict would keep only its last column)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engine.engine import Engine
from rollout.eval.cli import main
from rollout.presets import tiny_model, tiny_tokenizer

PROMPTS = ["2 + 2 =", "x" * 200, "3 + 3 ="]
TINY = ["--max-new-tokens", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tiny_model(seed=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def greedy(model_dir: Path, prompt: str, max_new_tokens: int = 4) -> list[int]:
    """transformers' greedy completion of `prompt` (token ids, through its first stop token)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tiny_tokenizer()(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens)
    return output[0, ids["input_ids"].shape[1] :].tolist()


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps(dict(prompt=p, answer="4")) + "\n" for p in prompts))
    return path


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_samples_the_engine_fails_keep_the_others_rows(model_dir, tmp_path, capsys):
    """A KV cache too small for the long prompt only: the error names it, and the two short prompts' rows are written
    with generate's tokens, the long one's with its error; no stale summary is left beside them."""
    dataset, output = write_jsonl(tmp_path / "mixed.jsonl", PROMPTS), tmp_path / "rows.jsonl"
    Path(f"{output}.summary.json").write_text('{"an earlier run": true}')
    flags = ["--model", model_dir, "--dataset", dataset, *TINY, "--output", output]
    assert main([str(f) for f in [*flags, "--batch-config", "num_blocks=4", "block_size=16"]]) == 2
    err = capsys.readouterr().err
    assert "1 of 3 samples failed in the engine" in err and str(output) in err and "Traceback" not in err
    rows = rows_of(output)
    assert [row["finish_reason"] for row in rows] == ["length", "error", "length"]
    assert "KV blocks" in rows[1]["error"] and rows[1]["token_ids"] == []
    for row in (rows[0], rows[2]):
        assert row["token_ids"] == greedy(model_dir, PROMPTS[row["prompt_index"]])
        assert row["prompt"] == PROMPTS[row["prompt_index"]]
    assert not Path(f"{output}.summary.json").exists()


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_while_generating_keeps_the_finished_samples(model_dir, tmp_path, capsys, monkeypatch, signum, status):
    """Ctrl-C once the first prompt (which stops early at its eos) is done: exit status 130, a message saying where its
    row is, and that row holds generate's tokens. SIGTERM (a scheduler's stop) the same, with status 143 (it ended
    the run with no row written)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.generation_config.eos_token_id = greedy(model_dir, PROMPTS[0], 3)[-1]  # the first prompt stops early
    stopping = tmp_path / "model"
    model.save_pretrained(stopping)
    tiny_tokenizer().save_pretrained(stopping)
    short = greedy(stopping, PROMPTS[0], 64)
    assert len(short) <= 3
    step, finished = Engine.step, []

    def interrupted_step(self):  # the signal at the step after the first prompt's last
        if finished:
            os.kill(os.getpid(), signum)
        outputs = step(self)
        finished.extend(o for o in outputs if o.request_id == "req_0" and len(o.prompt_ids) > 1)  # not the warm-up's
        return outputs

    monkeypatch.setattr(Engine, "step", interrupted_step)
    dataset, output = write_jsonl(tmp_path / "rows.jsonl", [PROMPTS[0], PROMPTS[2]]), tmp_path / "out.jsonl"
    flags = ["--model", stopping, "--dataset", dataset, "--max-new-tokens", "64", "--device", "cpu", "--output", output]
    assert main([str(flag) for flag in flags]) == status
    err = capsys.readouterr().err
    stopped = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert f"rollout-eval: {stopped} while generating; the 1 of 2 samples finished, unscored, are in {output}" in err
    (row,) = rows_of(output)
    assert (row["prompt_index"], row["finish_reason"], row["token_ids"]) == (0, "stop", short)


def test_ctrl_c_before_any_sample_finished_keeps_an_earlier_runs_rows(model_dir, tmp_path, capsys, monkeypatch):
    def interrupted_step(self):  # at the first step, the warm-up's
        raise KeyboardInterrupt

    dataset, output = write_jsonl(tmp_path / "rows.jsonl", [PROMPTS[0]]), tmp_path / "out.jsonl"
    output.write_text("an earlier run's rows\n")
    monkeypatch.setattr(Engine, "step", interrupted_step)
    assert main([str(f) for f in ["--model", model_dir, "--dataset", dataset, *TINY, "--output", output]]) == 130
    assert "rollout-eval: interrupted\n" in capsys.readouterr().err
    assert output.read_text() == "an earlier run's rows\n"


def test_a_failing_metric_leaves_no_earlier_summary_beside_its_rows(model_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "failing_metric.py").write_text("def score(completion, answer):\n    raise ValueError('no')\n")
    monkeypatch.chdir(tmp_path)
    dataset, output = write_jsonl(tmp_path / "rows.jsonl", [PROMPTS[0]]), tmp_path / "out.jsonl"
    flags = ["--model", model_dir, "--dataset", dataset, *TINY, "--output", output, "--answer-field", "answer"]
    assert main([str(flag) for flag in flags]) == 0
    assert json.loads(Path(f"{output}.summary.json").read_text())["samples"] == 1
    assert main([str(flag) for flag in [*flags, "--metric", "failing_metric:score"]]) == 2
    assert "unscored" in capsys.readouterr().err and len(rows_of(output)) == 1
    assert not Path(f"{output}.summary.json").exists()


@pytest.mark.parametrize(
    "name, text",
    [
        ("bom.csv", "\ufeffprompt,answer\n2 + 2 =,4\n3 + 3 =,6\n"),
        ("bom.jsonl", '\ufeff{"prompt": "2 + 2 =", "answer": "4"}\n{"prompt": "3 + 3 =", "answer": "6"}\n'),
        ("indented.json", '\n  [{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": "3 + 3 =", "answer": "6"}]\n'),
        ("bom.json", '\ufeff[{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": "3 + 3 =", "answer": "6"}]'),
    ],
)
def test_a_byte_order_mark_or_an_indented_array_reads_as_the_plain_file(model_dir, tmp_path, capsys, name, text):
    """The rows equal the plain JSONL file's, and datasets' own reader of the file sees the same fields."""
    import datasets

    dataset = tmp_path / name
    dataset.write_text(text, encoding="utf-8")
    plain = write_jsonl(tmp_path / "plain.jsonl", ["2 + 2 =", "3 + 3 ="])
    got, want = tmp_path / "got.jsonl", tmp_path / "want.jsonl"
    for source, output in ((dataset, got), (plain, want)):
        assert main([str(f) for f in ["--model", model_dir, "--dataset", source, *TINY, "--output", output]]) == 0
    assert [(r["prompt"], r["token_ids"]) for r in rows_of(got)] == [
        (r["prompt"], r["token_ids"]) for r in rows_of(want)
    ]
    builder = "csv" if name.endswith(".csv") else "json"
    reference = datasets.load_dataset(builder, data_files=str(dataset), split="train")
    assert reference.column_names == ["prompt", "answer"] and reference["prompt"] == ["2 + 2 =", "3 + 3 ="]


def test_a_csv_header_naming_a_field_twice_is_refused(tmp_path, capsys):
    dataset = tmp_path / "twice.csv"
    dataset.write_text("prompt,prompt\n2 + 2 =,3 + 3 =\n")
    assert main([str(f) for f in ["--model", "tiny", "--dataset", dataset, *TINY]]) == 2
    err = capsys.readouterr().err
    assert f"--dataset {dataset}: line 1: the header names the field 'prompt' twice" in err


def test_a_csv_header_with_trailing_empty_names_reads_as_datasets_reads_it(tmp_path):
    """A spreadsheet's trailing commas give empty names, which no flag can ask for: read, as `datasets` reads the
    file (naming them Unnamed: 2, ...), not refused as a field named twice."""
    import datasets

    from rollout.eval.file_rows import read_file_rows

    dataset = tmp_path / "trailing.csv"
    dataset.write_text("prompt,answer,,\n2 + 2 =,4,,\n3 + 3 =,6,,\n")
    rows = read_file_rows(str(dataset), str(dataset), ".csv", 1 << 20)
    reference = datasets.load_dataset("csv", data_files=str(dataset), split="train", cache_dir=str(tmp_path / "c"))
    assert [row["prompt"] for row in rows] == reference["prompt"] == ["2 + 2 =", "3 + 3 ="]
    assert [row["answer"] for row in rows] == ["4", "6"]

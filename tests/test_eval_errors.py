"""`rollout-eval`'s errors a newcomer meets: each is one line on stderr naming the flag and saying what to do, exit
status 2, never a traceback. Also its helpers against references: `--batch-config` against the config's own fields,
the Wilson interval against Newcombe's published values, percentiles against numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.batch_config_flags import batch_config_from_pairs
from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.eval.cli import main
from rollout.eval.metrics import numeric
from rollout.eval.stats import percentile, wilson_interval
from rollout.service.presets import tiny_model, tiny_tokenizer

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"
BASE = ["--model", "tiny", "--dataset", str(REPO_DATASET), "--prompt-field", "question", "--max-new-tokens", "2"]


def error_of(capsys, flags: list[str]) -> str:
    """rollout-eval's stderr for `flags`, checked to be one error line with exit status 2."""
    assert main([str(flag) for flag in flags]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rollout-eval: error: ")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("rollout-eval: error: ")


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """A hub endpoint nothing listens on and an empty hub cache: a machine with no network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_a_hub_model_with_no_network(capsys, unreachable_hub):
    message = error_of(capsys, [*BASE[2:], "--model", "someone/some-model"])
    assert message.startswith("--model someone/some-model: not a local path, 127.0.0.1 cannot be reached")
    assert "hf download someone/some-model --local-dir DIR" in message


def test_a_hub_dataset_with_no_network(capsys, unreachable_hub):
    message = error_of(capsys, ["--model", "tiny", "--dataset", "someone/some-data:main", "--prompt-field", "q"])
    assert message.startswith("--dataset someone/some-data: not a local path, 127.0.0.1 cannot be reached")
    assert "--repo-type dataset" in message


def test_a_hub_model_in_offline_mode_and_not_cached(capsys, unreachable_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = error_of(capsys, [*BASE[2:], "--model", "someone/some-model"])
    assert "offline mode is on (HF_HUB_OFFLINE)" in message


def test_a_missing_dataset_file(capsys, tmp_path):
    message = error_of(capsys, ["--model", "tiny", "--dataset", tmp_path / "gsm8k.jsonl"])
    assert message == f"--dataset {tmp_path / 'gsm8k.jsonl'}: no such file"


def test_a_missing_model_directory(capsys, tmp_path):
    message = error_of(capsys, [*BASE[2:], "--model", tmp_path / "nothing-here"])
    assert message == f"--model {tmp_path / 'nothing-here'}: no such file or directory"


@pytest.mark.parametrize("flag", ["--prompt-field", "--answer-field"])
def test_a_field_that_does_not_exist_lists_those_that_do(capsys, flag):
    flags = [*BASE, flag, "query"] if flag == "--answer-field" else [*BASE[:4], flag, "query"]
    message = error_of(capsys, flags)
    assert message == f"{flag} query: {REPO_DATASET} has no such field; its fields are: question, answer"


def test_chat_with_a_tokenizer_without_a_chat_template(capsys, tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    tiny_model().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    message = error_of(capsys, [*BASE[2:], "--model", tmp_path, "--chat"])
    assert message.startswith(f"--chat: the tokenizer of {tmp_path} has no chat template; drop --chat")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_flag_on_a_cpu_torch(capsys, device):
    message = error_of(capsys, [*BASE, "--device", device])
    assert message.startswith(f"--device {device}: torch {torch.__version__} (a CPU-only build) sees no CUDA device")
    assert "--device cpu" in message


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("no_such_module_here:score", "cannot import no_such_module_here (ModuleNotFoundError"),
        ("json:no_such_function", "json has no function no_such_function"),
        ("accuracy", "expected exact_match, numeric or module:function"),
    ],
)
def test_a_metric_that_cannot_be_imported(capsys, metric, expected):
    message = error_of(capsys, [*BASE, "--answer-field", "answer", "--metric", metric])
    assert message.startswith(f"--metric {metric}: ") and expected in message


def test_a_metric_that_returns_no_verdict(capsys, tmp_path, monkeypatch):
    (tmp_path / "odd_metric.py").write_text("def score(completion, answer):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = error_of(capsys, [*BASE, "--answer-field", "answer", "--metric", "odd_metric:score"])
    assert message == "--metric odd_metric:score returned 0.5; a metric returns True or False"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--temperature", "0.7", "--compare-with-generate", "2"], "--compare-with-generate compares greedy decoding"),
        (["--n", "4"], "--n 4 with greedy decoding (--temperature 0) gives 4 identical samples"),
        (["--top-p", "0.9"], "--top-p 0.9 has no effect with greedy decoding"),
        (["--metric", "numeric"], "--metric numeric scores against reference answers: pass --answer-field too"),
        (["--num-samples", "0"], "--num-samples 0: must be at least 1"),
        (["--output", "/no/such/folder/rows.jsonl"], "--output /no/such/folder/rows.jsonl: no such directory"),
        (["--split", "test"], "--split test: Unknown split"),
        (["--batch-config", "num_blocks=many"], "--batch-config num_blocks: expected an integer, got 'many'"),
        (["--batch-config", "blocks=4"], "--batch-config blocks: is not a ContinuousBatchingConfig field"),
        (["--seed", "1", "--batch-config", "seed=2"], "--seed and --batch-config seed=... both set the run's seed"),
    ],
)
def test_flags_that_cannot_work_are_refused_by_name(capsys, flags, expected):
    assert expected in error_of(capsys, [*BASE, *flags])


def test_batch_config_pairs_read_as_their_fields_types():
    config = batch_config_from_pairs(
        ["num_blocks=64", "max_memory_percent=none", "scheduler_type=prefill_first", "overlap_scheduling=off"]
        + ["previous_paths=fp32_head,logprobs", "max-batch-tokens=512", "fp32_logits=true"],
        seed=3,
    )
    assert config == ContinuousBatchingConfig(
        num_blocks=64,
        max_memory_percent=None,
        scheduler_type="prefill_first",
        overlap_scheduling=False,
        previous_paths=("fp32_head", "logprobs"),
        max_batch_tokens=512,
        fp32_logits=True,
        seed=3,
    )
    with pytest.raises(FieldError, match="scheduler_type"):  # the config's own validation still applies
        batch_config_from_pairs(["scheduler_type=lifo"])
    with pytest.raises(FieldError, match="decode_compile_config: is not a ContinuousBatchingConfig field settable"):
        batch_config_from_pairs(["decode_compile_config=x"])


def test_wilson_interval_matches_newcombes_published_values():
    """Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (score)."""
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)


def test_percentile_matches_numpy():
    values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    for q in (0, 50, 90, 95, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [  # answers as GSM8K's test split writes them
        ("She has 5 + 3 = 8 apples. #### 8", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 8", True),
        ("The total is $1,234.", "#### 1234", True),
        ("So the answer is 18.0", "#### 18", True),
        ("First 3, then 4, so 7 in all", "#### 7", True),
        ("#### 7 (not 8)", "#### 7", True),
        ("It is 12", "#### -12", False),
        ("no number here", "#### 3", False),
    ],
)
def test_numeric_metric_reads_gsm8k_answers(completion, answer, correct):
    assert numeric(completion, answer) is correct

"""`rollout-eval`'s errors a newcomer meets: each is one line on stderr naming the flag and saying what to do, exit
status 2, never a traceback. Also its helpers against references: `--batch-config` against the config's own fields,
the Wilson interval against Newcombe's published values, percentiles against numpy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rollout.eval.cli import main
from rollout.presets import tiny_model, tiny_tokenizer

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


def test_the_generate_batch_example_with_a_hub_model_and_no_network(capsys, unreachable_hub):
    import importlib.util

    path = REPO_DATASET.parents[1] / "generate_batch.py"
    spec = importlib.util.spec_from_file_location("generate_batch_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as stop:
        example.main(["--model", "someone/some-model"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --model someone/some-model: not a local path, 127.0.0.1 cannot be reached" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--samples", "--max-new-tokens"])
def test_the_generate_batch_example_names_a_count_below_one(capsys, flag):
    """examples/generate_batch.py --samples 0 (or --max-new-tokens 0) is a usage error naming the flag; it was the
    engine's traceback naming its own fields (n, max_new_tokens)."""
    import importlib.util

    path = REPO_DATASET.parents[1] / "generate_batch.py"
    spec = importlib.util.spec_from_file_location("generate_batch_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as stop:
        example.main([flag, "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag} 0: must be at least 1" in err


def test_a_hub_dataset_with_no_network(capsys, unreachable_hub):
    message = error_of(capsys, ["--model", "tiny", "--dataset", "someone/some-data:main", "--prompt-field", "q"])
    assert message.startswith("--dataset someone/some-data:main: not a local path, 127.0.0.1 cannot be reached")
    # the config goes with the downloaded directory (DIR alone: datasets' "Config name is missing")
    assert "(`hf download someone/some-data --repo-type dataset --local-dir DIR`) and pass DIR:main," in message


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


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.version.cuda is not None,
    reason="checks the message of a CPU-only torch build (a CUDA build without a GPU says so instead)",
)
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_flag_on_a_cpu_torch(capsys, device):
    message = error_of(capsys, [*BASE, "--device", device])
    assert message.startswith(f"--device {device}: torch {torch.__version__} (a CPU-only build) sees no CUDA device")
    assert "--device cpu" in message


METRIC_MODULES = {
    "broken_syntax": "def score(completion, answer):\n    return (\n",
    "needs_a_library": "import no_such_library_anywhere\n",
    "raises_on_rows": "def score(completion, answer):\n    raise ValueError('cannot parse')\n",
    "gives_arrays": "import numpy\ndef score(completion, answer):\n    return numpy.array([True, False])\n",
    "gives_halves": "def score(completion, answer):\n    return 0.5\n",
    "gives_numpy_bools": "import numpy\ndef score(completion, answer):\n    return numpy.bool_(True)\n",
}


@pytest.fixture
def metric_folder(tmp_path, monkeypatch):
    """A directory of metric modules, the current one (as a user runs rollout-eval next to their metric)."""
    for name, source in METRIC_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("no_such_module_here:score", "no module named no_such_module_here; run from the directory that holds"),
        ("json:no_such_function", "json has no function no_such_function"),
        ("accuracy", "expected exact_match, numeric or module:function"),
        ("broken_syntax:score", "importing broken_syntax failed: SyntaxError"),
        ("needs_a_library:score", "needs_a_library imports no_such_library_anywhere, which is not installed"),
        ("broken_syntax.py:score", "name the module, not its file: --metric broken_syntax:score"),
    ],
)
def test_a_metric_that_cannot_be_imported(capsys, metric_folder, metric, expected):
    message = error_of(capsys, [*BASE, "--answer-field", "answer", "--metric", metric])
    assert message.startswith(f"--metric {metric}: ") and expected in message
    assert str(metric_folder) not in sys.path  # the current directory was importable only while importing


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("raises_on_rows:score", "--metric raises_on_rows:score raised ValueError on row 0: cannot parse"),
        ("gives_arrays:score", "--metric gives_arrays:score returned array([ True, False]) on row 0; a metric"),
        ("gives_halves:score", "--metric gives_halves:score returned 0.5 on row 0; a metric returns True or False"),
    ],
)
def test_a_metric_that_gives_no_verdict_names_the_row_and_keeps_the_rows(capsys, metric_folder, metric, expected):
    output = metric_folder / "rows.jsonl"
    message = error_of(capsys, [*BASE, "--answer-field", "answer", "--metric", metric, "--output", output])
    assert message.startswith(expected) and message.endswith(f"(the rows, unscored, are in {output})")
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 12 and all("correct" not in row and row["token_ids"] for row in rows)


def test_numpy_bools_are_verdicts(capsys, metric_folder):
    assert main([*BASE, "--answer-field", "answer", "--metric", "gives_numpy_bools:score"]) == 0
    assert "accuracy (gives_numpy_bools:score): 1.0000 (12/12" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--temperature", "0.7", "--compare-with-generate", "2"], "--compare-with-generate compares greedy decoding"),
        (["--n", "4", "--temperature", "0"], "--n 4 with greedy decoding (--temperature 0) gives 4 identical samples"),
        (["--n", "2", "--compare-with-generate", "2"], "sampling at temperature 1.0 cannot match: use --n 1"),
        (["--top-p", "0.9"], "--top-p 0.9 has no effect with greedy decoding"),
        (["--top-k", "5"], "--top-k 5 has no effect with greedy decoding"),
        (["--seed", "3"], "--seed 3 has no effect with greedy decoding"),
        (["--temperature", "1", "--top-k", "-1"], "--top-k -1: must be 0 (off) or more"),
        (["--metric", "numeric"], "--metric numeric scores against reference answers: pass --answer-field too"),
        (["--num-samples", "0"], "--num-samples 0: must be at least 1"),
        (["--output", "/no/such/folder/rows.jsonl"], "--output /no/such/folder/rows.jsonl: no such directory"),
        (["--split", "test"], "--split test: a file has one split, train (slices such as train[:100] work)"),
        (["--batch-config", "num_blocks=many"], "--batch-config num_blocks: expected an integer, got 'many'"),
        (["--batch-config", "blocks=4"], "--batch-config blocks: is not a ContinuousBatchingConfig field"),
        (["--temperature", "1", "--seed", "1", "--batch-config", "seed=2"], "--seed and --batch-config seed=... both"),
        (["--batch-config", "num_blocks=8", "--batch-config", "num_blocks=9"], "num_blocks: is given twice"),
        (["--temperature", "1e-7"], "--temperature 1e-07: must be 0 (greedy) or a finite number >= 1e-05"),
        (["--temperature", "inf"], "--temperature inf: must be 0 (greedy) or a finite number"),
        (["--device", "mps"], "--device mps: not a device rollout runs on; give cpu, cuda or cuda:N (N: a CUDA"),
        (["--device", "meta"], "--device meta: not a device rollout runs on; give cpu, cuda or cuda:N (N: a CUDA"),
        (["--device", "tpu"], "--device tpu: not a device rollout runs on; give cpu, cuda or cuda:N (N: a CUDA"),
        (["--device", ""], "--device '': empty; give a value"),  # was: the default device, silently
        (["--split", ""], "--split '': empty; give a value"),  # was: train, silently
        (["--answer-field", "answer", "--metric", ""], "--metric '': empty; give a value"),  # was: exact_match
        (["--output", ""], "--output '': name a file to write the rows to"),
        (["--output", "/tmp"], "--output '/tmp': name a file to write the rows to"),
        (["--output", str(REPO_DATASET)], f"--output {REPO_DATASET} is the dataset itself"),
        (["--dataset", "notes.txt"], "--dataset notes.txt: no such file"),
        (["--batch-config", "num_blocks=1", "block_size=1"], "12 of 12 samples failed in the engine: request needs"),
        (
            ["--batch-config", "max_model_len=8"],
            "row 0: its prompt (20 tokens) + --max-new-tokens 2 exceeds the model's",
        ),
    ],
)
def test_flags_that_cannot_work_are_refused_by_name(capsys, flags, expected):
    assert expected in error_of(capsys, [*BASE, *flags])


# Datasets a newcomer writes by hand: each flaw named with its line or row.
BAD_DATASETS = {
    "empty.jsonl": ("", "no rows"),
    "blank.jsonl": ("\n\n", "no rows"),
    "header_only.csv": ("prompt,answer\n", "no rows"),
    "array.json": ("[]", "no rows"),
    "not_json.jsonl": ('{"prompt": "a"}\n\n{"prompt": \n', "line 3 (row 1) is not JSON (Expecting value)"),  # as below
    "ragged.csv": ("prompt,answer\nhi,1,extra\nyo,2\n", "line 2 (row 0) has 3 fields, the header 2"),
    "scalars.json": ("[1, 2]", "row 0 is a int, not an object of fields"),
    # json.loads keeps a field's last value: "second" was evaluated without a word (a CSV header is refused alike)
    "twice.jsonl": (
        '{"prompt": "a"}\n{"prompt": "first", "prompt": "second"}\n',
        "line 2 (row 1) names the field 'prompt' twice",
    ),
    "twice.json": (
        '[{"prompt": "a", "meta": {"src": 1, "src": 2}}, {"prompt": "b", "prompt": "c"}]',  # (meta: read as json does)
        "row 1 names the field 'prompt' twice",
    ),
    "no_answer.jsonl": ('{"prompt": "a", "answer": "5"}\n{"prompt": "b", "answer": null}\n', "row 1 has no answer"),
    "list_answer.jsonl": ('{"prompt": "a", "answer": ["5", "five"]}\n', "row 0 holds a list, not text or a number"),
    "dict_prompt.jsonl": ('{"prompt": {"role": "user", "content": "hi"}, "answer": "a"}\n', "row 0 holds a dict"),
    "list_prompt.jsonl": ('{"prompt": ["a", "b"], "answer": "a"}\n', "row 0 holds a list, not text; pass --chat"),
    "missing_field.jsonl": ('{"prompt": "a", "answer": "1"}\n\n{"answer": "2"}\n', "--prompt-field prompt: row 1 of"),
}


@pytest.mark.parametrize("name", sorted(BAD_DATASETS))
def test_hand_written_datasets_are_refused_naming_the_flaw(capsys, tmp_path, name):
    text, expected = BAD_DATASETS[name]
    (tmp_path / name).write_text(text)
    flags = ["--model", "tiny", "--dataset", tmp_path / name, "--answer-field", "answer", "--max-new-tokens", "2"]
    assert expected in error_of(capsys, flags)


def test_chat_refuses_a_list_that_is_not_of_messages(capsys, tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"prompt": [1, 2, 3]}\n')
    message = error_of(capsys, ["--model", "tiny", "--dataset", tmp_path / "rows.jsonl", "--chat"])
    assert (
        message
        == '--prompt-field prompt: row 0 is a list but not of chat messages ({"role": ..., "content": ...} each)'
    )


def test_csv_fields_and_json_values_reach_the_metric_as_written(capsys, tmp_path, monkeypatch):
    """CSV fields stay text ("007", "NA"), JSON numbers stay as written (5 beside 2.5 is not 5.0; 1.50 is not 1.5), in
    JSON lines and in a JSON array."""
    (tmp_path / "seen.py").write_text(
        "SEEN = []\ndef score(completion, answer):\n    SEEN.append(answer)\n    return False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rows.csv").write_text("prompt,answer\nfirst,007\nsecond,NA\nthird,1.50\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "answer": 5}\n{"prompt": "b", "answer": 2.5}\n')
    (tmp_path / "rows.json").write_text('[{"prompt": "c", "answer": 1.50}, {"prompt": "d", "answer": 2E3}]')
    import seen

    for dataset in ("rows.csv", "rows.jsonl", "rows.json"):
        flags = [
            "--model",
            "tiny",
            "--dataset",
            tmp_path / dataset,
            "--answer-field",
            "answer",
            "--metric",
            "seen:score",
        ]
        assert main([*(str(flag) for flag in flags), "--max-new-tokens", "1"]) == 0
    assert seen.SEEN == ["007", "NA", "1.50", "5", "2.5", "1.50", "2E3"]


def test_a_model_directory_without_tokenizer_files(capsys, tmp_path):
    tiny_model().save_pretrained(tmp_path)
    message = error_of(capsys, [*BASE[2:], "--model", tmp_path])
    assert message.startswith(f"--model {tmp_path}: no tokenizer files were found with it")


@pytest.mark.parametrize(
    ("flags", "temperature"), [([], 0.0), (["--n", "2"], 1.0), (["--n", "2", "--temperature", "0.5"], 0.5)]
)
def test_n_above_one_samples_unless_a_temperature_is_given(flags, temperature):
    """Without --temperature, one sample per prompt is greedy and several are sampled at 1.0 (identical samples
    would make pass@k meaningless); a given temperature is kept."""
    from rollout.eval.cli import build_parser, check_flags

    args = build_parser().parse_args(["--model", "tiny", "--dataset", str(REPO_DATASET), *flags])
    check_flags(args)
    assert args.temperature == temperature


def test_ctrl_c_says_it_was_interrupted(capsys, monkeypatch):
    """Ctrl-C while generating: status 130 and "interrupted" (the empty text of a bare KeyboardInterrupt was
    printed: "rollout-eval: " and nothing more)."""
    import rollout.eval.session as session

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "evaluate", interrupted)
    assert main([str(flag) for flag in BASE]) == 130
    assert capsys.readouterr().err.strip() == "rollout-eval: interrupted"

"""`rollout-eval`: rows, summary and the comparison with transformers' `generate`, on a tiny model whose head is scaled
to a realistic entropy (a random model's near-uniform logits would hide a mismatch), and JSONL / CSV / Parquet files.
The references: transformers' `generate` (greedy completions, which the answers of the accuracy test are made of),
`datasets` (the CSV and Parquet files are written by it), a brute-force pass@k over every k-subset."""

from __future__ import annotations

import itertools
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.eval.cli import main
from rollout.presets import tiny_model, tiny_tokenizer

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model, its head scaled to a realistic entropy, saved with its tokenizer as a model directory."""
    folder = tmp_path_factory.mktemp("model")
    model, tokenizer = tiny_model(seed=3), tiny_tokenizer()
    prompts = [tokenizer(json.loads(line)["question"])["input_ids"] for line in REPO_DATASET.read_text().splitlines()]
    scale_to_entropy(model, prompts)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(capsys, *flags: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of rollout-eval with `flags`."""
    status = main([str(flag) for flag in flags])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err


def read_output(path: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows, json.loads(Path(f"{path}.summary.json").read_text())


def reference_completions(model_dir: Path, questions: list[str]) -> list[str]:
    """transformers' greedy `generate` of each question, decoded as rollout-eval decodes completions."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = []
    for question in questions:
        prompt = tokenizer(question, return_tensors="pt")
        output = model.generate(**prompt, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        texts.append(tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
    return texts


def test_rows_and_accuracy_against_generate(model_dir, tmp_path, capsys):
    """On the repository's dataset, with answers that are transformers' greedy completions for even rows and wrong
    for odd ones: one row per prompt with every field, the even rows (exactly) correct, and the printed and written
    accuracy the rows' mean."""
    rows = [json.loads(line) for line in REPO_DATASET.read_text().splitlines()]
    reference = reference_completions(model_dir, [row["question"] for row in rows])
    dataset = tmp_path / "answers.jsonl"
    dataset.write_text(
        "".join(
            json.dumps(dict(question=row["question"], target=text if i % 2 == 0 else "not it")) + "\n"
            for i, (row, text) in enumerate(zip(rows, reference))
        )
    )
    output = tmp_path / "rows.jsonl"
    status, out, err = run(
        capsys,
        *("--model", model_dir, "--dataset", dataset, "--prompt-field", "question", "--answer-field", "target"),
        *("--max-new-tokens", MAX_NEW_TOKENS, "--output", output, "--device", "cpu"),
    )
    assert status == 0, err
    written, summary = read_output(output)
    assert len(written) == len(rows)
    tokenizer = tiny_tokenizer()
    for index, row in enumerate(written):
        assert row["prompt_index"] == index and row["sample_index"] == 0
        assert row["prompt"] == rows[index]["question"]
        assert row["completion"] == reference[index]
        assert row["completion"] == tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        assert len(row["logprobs"]) == len(row["token_ids"]) <= MAX_NEW_TOKENS
        assert all(logprob <= 0 for logprob in row["logprobs"])
        assert row["finish_reason"] in ("stop", "length")
        assert row["correct"] is (index % 2 == 0)
    accuracy = sum(row["correct"] for row in written) / len(written)
    assert summary["accuracy"] == accuracy == 0.5
    low, high = summary["accuracy_interval"]
    assert low < accuracy < high
    assert any(line.startswith("accuracy (exact_match): 0.5000") for line in out), out
    assert summary["output_tokens"] == sum(len(row["token_ids"]) for row in written)
    assert sum(summary["finish_reasons"].values()) == len(written)
    assert "pass_at_k" not in summary  # n == 1


def samples_are_greedy(model_dir, tmp_path, capsys, model, *flags) -> None:
    """Two samples of each of three questions at temperature 1 (with `flags`, from `model`) are transformers' greedy
    completions of `model_dir`."""
    questions = [json.loads(line)["question"] for line in REPO_DATASET.read_text().splitlines()][:3]
    reference = reference_completions(model_dir, questions)
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text("".join(json.dumps(dict(question=question)) + "\n" for question in questions))
    output = tmp_path / "rows.jsonl"
    status, _, err = run(
        capsys,
        *("--model", model, "--dataset", dataset, "--prompt-field", "question", "--n", 2, "--temperature", 1.0),
        *(*flags, "--seed", 3, "--max-new-tokens", MAX_NEW_TOKENS, "--output", output, "--device", "cpu"),
    )
    assert status == 0, err
    written, _ = read_output(output)
    assert [row["completion"] for row in written] == [text for text in reference for _ in range(2)]


def test_top_k_1_samples_what_generate_picks_greedily(model_dir, tmp_path, capsys):
    """--top-k reaches the sampler: with k = 1, samples at temperature 1 are transformers' greedy completions."""
    samples_are_greedy(model_dir, tmp_path, capsys, model_dir, "--top-k", 1)


def test_the_models_own_top_p_applies_without_the_flag(model_dir, tmp_path, capsys):
    """Without --top-p (and --top-k), the model's generation config's apply, as in transformers' generate: a model
    whose config keeps only the likeliest token samples its greedy completions at temperature 1."""
    import shutil

    from transformers import GenerationConfig

    narrow = tmp_path / "narrow"
    shutil.copytree(model_dir, narrow)
    config = GenerationConfig.from_model_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    config.do_sample, config.top_p, config.top_k = True, 1e-6, 0  # as Qwen3 ships its own top_p
    config.save_pretrained(narrow)
    samples_are_greedy(model_dir, tmp_path, capsys, narrow)


def compared_with_config(model_dir, tmp_path, capsys, samples: int, **settings) -> tuple[Path, list, dict]:
    """rollout-eval --compare-with-generate over a copy of the model whose generation config sets `settings`;
    returns (the copy, the rows, the summary)."""
    import shutil

    from transformers import GenerationConfig

    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    config = GenerationConfig.from_model_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    for name, value in settings.items():
        setattr(config, name, value)
    config.save_pretrained(changed)
    output = tmp_path / "rows.jsonl"
    status, out, err = run(
        capsys,
        *("--model", changed, "--dataset", REPO_DATASET, "--prompt-field", "question", "--num-samples", samples),
        *("--max-new-tokens", MAX_NEW_TOKENS, "--compare-with-generate", samples, "--output", output),
        *("--device", "cpu"),
    )
    assert status == 0, err
    return (changed, *read_output(output))


def test_the_models_own_num_return_sequences_does_not_reach_the_comparison(model_dir, tmp_path, capsys):
    """A model whose generation config samples several sequences (do_sample with num_return_sequences 2) is compared
    greedily with generate all the same: --n is rollout-eval's own, and the model's count merged into generate's greedy
    config made generate refuse it, a traceback after the rows were written. The reference: transformers' greedy
    `generate` of one sequence."""
    _, rows, summary = compared_with_config(model_dir, tmp_path, capsys, 2, do_sample=True, num_return_sequences=2)
    assert [row["completion"] for row in rows] == reference_completions(model_dir, [row["prompt"] for row in rows])
    assert summary["compare_with_generate"]["identical"] == 2


def test_the_models_own_stop_strings_apply_in_the_comparison(model_dir, tmp_path, capsys):
    """A model whose generation config has stop_strings: rollout stops on them (given the tokenizer), and so does the
    comparison's generate, which needs the tokenizer too (without it generate refused, a traceback after the rows).
    The reference: transformers' greedy `generate` with the same stop string and the tokenizer."""
    question = json.loads(REPO_DATASET.read_text().splitlines()[0])["question"]
    completion = reference_completions(model_dir, [question])[0]
    stop = completion[4:6]  # met within the completion: it ends early
    stopping, rows, summary = compared_with_config(model_dir, tmp_path, capsys, 1, stop_strings=[stop])
    model, tokenizer = AutoModelForCausalLM.from_pretrained(stopping).eval(), AutoTokenizer.from_pretrained(stopping)
    prompt = tokenizer(question, return_tensors="pt")
    expected = model.generate(**prompt, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, tokenizer=tokenizer)
    assert rows[0]["token_ids"] == expected[0, prompt["input_ids"].shape[1] :].tolist()
    assert stop in rows[0]["completion"] and len(rows[0]["token_ids"]) < MAX_NEW_TOKENS
    assert summary["compare_with_generate"]["identical"] == 1


def brute_force_pass_at_k(flags: list[bool], k: int) -> float:
    """The fraction of k-subsets of a prompt's samples holding a correct one (pass@k by its definition)."""
    subsets = list(itertools.combinations(flags, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_sampled_groups_with_a_module_metric(model_dir, tmp_path, capsys, monkeypatch):
    """n = 4 samples per prompt scored by a module:function metric: pass@k for k = 1, 2, 4 equals the brute force over
    every k-subset of each prompt's samples, pass@1 the accuracy; the same seed repeats the run."""
    (tmp_path / "early_letter_metric.py").write_text(
        "def early_letter(completion, answer):\n    return completion[:1] < 'n'\n"
    )  # a verdict that varies between samples
    monkeypatch.syspath_prepend(str(tmp_path))
    output = tmp_path / "rows.jsonl"
    flags = [
        *("--model", model_dir, "--dataset", REPO_DATASET, "--prompt-field", "question", "--answer-field", "answer"),
        *("--metric", "early_letter_metric:early_letter", "--n", 4, "--temperature", 1.0, "--top-p", 0.95, "--seed", 7),
        *("--max-new-tokens", 6, "--output", output, "--num-samples", 8),
    ]
    status, out, err = run(capsys, *flags)
    assert status == 0, err
    rows, summary = read_output(output)
    assert len(rows) == 8 * 4 and sorted({row["sample_index"] for row in rows}) == [0, 1, 2, 3]
    assert all(row["correct"] is (row["completion"][:1] < "n") for row in rows)
    by_prompt = [[row["correct"] for row in rows if row["prompt_index"] == p] for p in range(8)]
    assert 0 < summary["correct"] < len(rows), "the metric should split the samples"
    for k in (1, 2, 4):
        expected = sum(brute_force_pass_at_k(flags, k) for flags in by_prompt) / len(by_prompt)
        figure = summary["pass_at_k"][str(k)]
        assert figure["value"] == pytest.approx(expected)
        assert figure["interval"][0] <= figure["value"] <= figure["interval"][1]
        assert any(line.startswith(f"pass@{k}: ") for line in out)
    assert summary["pass_at_k"]["1"]["value"] == pytest.approx(summary["accuracy"])


def test_compare_with_generate_agrees_and_catches_an_altered_model(model_dir, capsys, monkeypatch):
    """--compare-with-generate: 100% agreement in fp32; with the model altered between rollout's run and generate's
    (its head negated), every compared prompt diverges at its first token, and the summary says where."""
    flags = ["--model", model_dir, "--dataset", REPO_DATASET, "--prompt-field", "question", "--max-new-tokens", 10]
    status, out, err = run(capsys, *flags, "--compare-with-generate", 4)
    assert status == 0, err
    assert "compare with transformers' generate (greedy, first 4 prompts): 4/4 identical, token agreement 100.0%" in out

    import rollout.eval.session as session

    real_generate = session.generate

    def generate_then_alter(model, *args, **kwargs):
        generated = real_generate(model, *args, **kwargs)
        with torch.no_grad():
            model.get_output_embeddings().weight.neg_()  # what a broken change to the model's code would do
        return generated

    monkeypatch.setattr(session, "generate", generate_then_alter)
    status, out, err = run(capsys, *flags, "--compare-with-generate", 3)
    assert status == 0, err
    assert "0/3 identical" in "\n".join(out), out
    assert (
        sum("first divergence at token 0" in line and "not a tie: check the model's code" in line for line in out) == 3
    )


def test_compare_with_generate_in_bf16_diverges_only_at_near_ties(model_dir, tmp_path, capsys):
    """In bf16 the engine's kernels and transformers' round differently, so greedy completions may part where two
    tokens' logits tie: every divergence must be such a near tie under generate's own logits (a real mismatch, as
    above, is not)."""
    output = tmp_path / "rows.jsonl"
    status, out, err = run(
        capsys,
        *("--model", model_dir, "--dataset", REPO_DATASET, "--prompt-field", "question", "--dtype", "bfloat16"),
        *("--max-new-tokens", 24, "--compare-with-generate", 12, "--output", output),
    )
    assert status == 0, err
    compared = read_output(output)[1]["compare_with_generate"]
    assert compared["prompts"] == 12 and compared["identical"] >= 6, out
    for prompt in compared["per_prompt"]:
        assert prompt["first_divergence"] is None or prompt["near_tie"], (prompt, out)


def test_csv_and_parquet_files_read_like_jsonl(tmp_path, capsys):
    """The repository's JSONL written as CSV and Parquet by `datasets` gives the same prompts and completions."""
    import datasets

    rows = datasets.load_dataset("json", data_files=str(REPO_DATASET), split="train")
    rows.to_csv(str(tmp_path / "arithmetic.csv"), index=False)
    rows.to_parquet(str(tmp_path / "arithmetic.parquet"))
    results = {}
    for dataset in (REPO_DATASET, tmp_path / "arithmetic.csv", tmp_path / "arithmetic.parquet"):
        output = tmp_path / f"{dataset.suffix[1:]}.out.jsonl"
        status, _, err = run(
            capsys,
            *("--model", "tiny", "--dataset", dataset, "--prompt-field", "question", "--num-samples", 5),
            *("--max-new-tokens", 5, "--output", output),
        )
        assert status == 0, err
        results[dataset.suffix] = [(row["prompt"], row["token_ids"]) for row in read_output(output)[0]]
    assert len(results[".jsonl"]) == 5 and results[".csv"] == results[".parquet"] == results[".jsonl"]


def test_a_dataset_directory_laid_out_as_on_the_hub(tmp_path, capsys):
    """A directory as `hf download openai/gsm8k --repo-type dataset` leaves it (a README declaring configs, Parquet
    files per config and split), read by `datasets` with DIR:config and --split."""
    import datasets

    rows = datasets.load_dataset("json", data_files=str(REPO_DATASET), split="train")
    (tmp_path / "main").mkdir()
    rows.select(range(4)).to_parquet(str(tmp_path / "main" / "train-00000-of-00001.parquet"))
    rows.select(range(4, 7)).to_parquet(str(tmp_path / "main" / "test-00000-of-00001.parquet"))
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n"
    )
    output = tmp_path / "rows.jsonl"
    flags = ["--model", "tiny", "--dataset", f"{tmp_path}:main", "--split", "test", "--prompt-field", "question"]
    status, _, err = run(capsys, *flags, "--max-new-tokens", 2, "--output", output)
    assert status == 0, err
    assert [row["prompt"] for row in read_output(output)[0]] == rows.select(range(4, 7))["question"]


def test_python_dash_m_runs_the_same_command(capsys, monkeypatch, tmp_path):
    """`python -m rollout.eval` is rollout-eval (the built-in tiny model; chat template applied). The process's
    ending (`exit_now`, tests/test_process_exit.py) is this test's: its status is raised as SystemExit."""
    from rollout.cli import process_exit

    monkeypatch.setattr(process_exit, "exit_now", sys.exit)
    output = tmp_path / "rows.jsonl"
    argv = ["rollout.eval", "--model", "tiny", "--dataset", str(REPO_DATASET), "--prompt-field", "question"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--chat", "--num-samples", "2", "--max-new-tokens", "3", "--output", str(output)]
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("rollout.eval", run_name="__main__")
    assert exit_info.value.code == 0
    assert len(read_output(output)[0]) == 2
    assert "gibberish" in capsys.readouterr().err


def test_the_installed_command(tmp_path):
    """`rollout-eval` is installed as a console script, and its cheap checks answer before torch loads."""
    answer = subprocess.run(["rollout-eval", "--help"], capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0 and "--compare-with-generate K" in answer.stdout
    answer = subprocess.run(
        ["rollout-eval", "--model", "tiny", "--dataset", "x.jsonl", "--n", "2", "--temperature", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answer.returncode == 2 and "pass --temperature above 0 to sample" in answer.stderr

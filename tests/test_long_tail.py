"""rollout-bench long-tail: every sample generates exactly its own length, preemption happens in a cache smaller than
the work, and the recompute figure the counters give matches an independent count."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout.benchmarks import cli
from rollout.benchmarks.gpu_report.table import rows
from rollout.benchmarks.grpo import long_tail, long_tail_table
from rollout.benchmarks.grpo.long_tail import measure
from rollout.benchmarks.grpo.long_tail_flags import Shape
from rollout.benchmarks.grpo.long_tail_probe import STUB_VOCAB
from rollout.benchmarks.grpo.long_tail_workload import make_workload
from rollout.benchmarks.harness.section_run import SectionResult

SMALL = Shape(num_prompts=8, n=4, median_tokens=64, max_tokens=256, prompt_tokens=(16, 64))
SMALL_FLAGS = ["--num-prompts", "8", "--n", "4", "--median-tokens", "64", "--max-tokens", "256"]
SMALL_FLAGS += ["--prompt-tokens", "16", "64", "--cache-fraction", "0.3"]
FIELDS = (
    "generated_tokens",
    "recomputed_tokens",
    "recomputed_tokens_by_position",
    "recompute_ratio",
    "preemptions",
    "preemptions_swapped",
    "swap_out_blocks",
    "swap_in_blocks",
    "swap_out_bytes",
    "swap_in_bytes",
    "steps",
    "mean_decoding_per_step",
    "mean_decoding_while_queued",
    "cache_holds_samples",
    "median_finish_s",
    "last_finish_s",
    "last_over_median_finish",
    "finished",
    "samples_finished",
    "samples_errored",
    "wall_s",
    "num_blocks",
    "peak_demand_blocks",
)


@pytest.fixture(scope="module")
def workload():
    return make_workload(SMALL, seed=0, vocab=STUB_VOCAB)


@pytest.fixture(scope="module")
def tight(workload):
    return measure(*workload, cache_fraction=0.3, progress=False)


def _minimum_tokens(summary: dict) -> int:
    """Tokens a run without preemption computes: each prompt's tokens at its first admission, and every generated
    token but each sample's last fed back once."""
    return summary["first_admission_prompt_tokens"] + summary["generated_tokens"] - summary["samples"]


def test_every_sample_generates_its_own_length_under_preemption(workload, tight):
    prompts, lengths = workload
    assert len({length for group in lengths for length in group}) > 20  # each sample its own length
    assert tight["finished"] and tight["samples_finished"] == 32
    assert tight["samples_errored"] == 0 and tight["samples_off_length"] == 0
    assert tight["generated_tokens"] == tight["tokens_to_generate"] == sum(map(sum, lengths))
    assert tight["num_blocks"] == math.ceil(0.3 * tight["peak_demand_blocks"])
    assert tight["preemptions"] > 0 and tight["readmissions"] == tight["preemptions"]  # recomputed, none swapped
    assert tight["steps"] > max(map(max, lengths))  # the longest sample decodes one token per step
    assert tight["last_over_median_finish"] > 1


def test_recompute_figure_matches_an_independent_count(workload, tight):
    recomputed = tight["computed_tokens"] - _minimum_tokens(tight)
    assert tight["recomputed_tokens"] == recomputed > 0
    assert tight["recompute_ratio"] == round(recomputed / tight["generated_tokens"], 4)
    # Counted from the batches: tokens at positions the same sample had already computed.
    assert tight["recomputed_tokens_by_position"] == recomputed
    # Each readmission recomputes what the prefix cache no longer holds (its last token would be a decode anyway).
    readmitted = tight["readmission_tokens"] - tight["readmission_prefix_hit_tokens"]
    assert readmitted - tight["readmissions"] <= recomputed
    # The engine's prefill_tokens: every prompt and recomputed token, and a readmission's last token where its chunk
    # was longer (a chunk of one, the last token alone, is a decode); a recompute chunk of one token that was not the
    # last had been counted as a decode.
    prefilled = tight["first_admission_prompt_tokens"] + recomputed
    assert prefilled <= tight["prefill_tokens"] <= prefilled + tight["readmissions"]
    # A cache that holds every sample at once: nothing preempted, nothing recomputed, the same tokens generated.
    roomy = measure(*workload, cache_fraction=1.0, progress=False)
    assert roomy["preemptions"] == 0 and roomy["readmissions"] == 0
    assert roomy["recomputed_tokens"] == roomy["recomputed_tokens_by_position"] == roomy["recompute_ratio"] == 0
    assert roomy["computed_tokens"] == _minimum_tokens(roomy)
    assert roomy["generated_tokens"] == tight["generated_tokens"] and roomy["steps"] < tight["steps"]
    # The prompt tokens a first admission computes plus what the prefix cache gave it are the group's prompts.
    assert roomy["first_admission_prompt_tokens"] + roomy["first_admission_prefix_hit_tokens"] == roomy["prompt_tokens"]


def test_swap_is_counted_in_blocks_out_and_back_in(workload):
    summary = measure(*workload, cache_fraction=0.3, cpu_offload_space=0.001, progress=False)  # 512 swap blocks
    assert summary["finished"] and summary["samples_off_length"] == 0
    assert summary["preemptions_swapped"] > 0 and summary["swap_space_blocks"] == int(0.001 * 2**30) // 2048
    assert summary["swap_out_blocks"] == summary["swap_in_blocks"] > 0  # every swapped sample came back
    assert summary["swap_out_bytes"] == summary["swap_out_blocks"] * summary["kv_block_bytes"]
    assert summary["recomputed_tokens"] == summary["recomputed_tokens_by_position"]
    swapped_only = summary["preemptions"] == summary["preemptions_swapped"]
    assert summary["readmissions"] == summary["preemptions"] - summary["preemptions_swapped"]
    assert not swapped_only or summary["recomputed_tokens"] == 0


def test_cli_prints_a_table_and_a_json_line_with_every_field(capsys):
    cli.main(["long-tail", *SMALL_FLAGS])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "long-tail" and summary["samples"] == 32 and summary["finished"]
    for field in FIELDS:
        assert summary[field] is not None, field
    assert summary["recompute_ratio"] > 0 and summary["preemptions"] > 0
    assert any(line.startswith("recomputed tokens") for line in lines[:-1])


def test_time_budget_cuts_the_run_and_says_so(workload):
    summary = measure(*workload, cache_fraction=0.3, time_budget_s=1e-9, progress=False)
    assert summary["finished"] is False and summary["samples_finished"] < summary["samples"]
    assert summary["last_over_median_finish"] is None and summary["recomputed_tokens"] >= 0
    line = long_tail_table.finish_line(summary)  # the table's row says why there is none, not "None (None s / None s)"
    assert "None" not in line and f"{summary['samples_finished']} of {summary['samples']} samples finished" in line


def test_the_time_budget_covers_the_set_up(monkeypatch):
    """A run's budget counts from the call, its model and engine set-up included: a caller sharing out its time
    (compare's pairs, gpu-report's speculative section before the kernel tests) is not overrun by a set-up it did
    not count. Here the set-up alone outlasts the budget: not a step runs."""
    import time

    slow = long_tail.build_model

    def slow_build(*args, **kwargs):
        time.sleep(1.0)
        return slow(*args, **kwargs)

    monkeypatch.setattr(long_tail, "build_model", slow_build)
    shape = Shape(num_prompts=2, n=2, median_tokens=16, max_tokens=48, prompt_tokens=(8, 24))
    prompts, lengths = make_workload(shape, seed=0, vocab=1024)
    summary = measure(prompts, lengths, model="tiny", cache_fraction=0.5, progress=False, time_budget_s=0.5)
    assert summary["finished"] is False and summary["generated_tokens"] == 0 and summary["steps"] == 0


def test_tiny_model_smoke():
    shape = Shape(num_prompts=2, n=2, median_tokens=16, max_tokens=48, prompt_tokens=(8, 24))
    prompts, lengths = make_workload(shape, seed=0, vocab=1024)
    summary = measure(prompts, lengths, model="tiny", cache_fraction=0.5, progress=False)
    assert summary["finished"] and summary["samples_off_length"] == 0 and summary["samples_errored"] == 0
    assert summary["generated_tokens"] == sum(map(sum, lengths))
    assert summary["recomputed_tokens"] == summary["recomputed_tokens_by_position"] >= 0


def test_speculative_side_by_side_on_the_low_entropy_tiny_model(capsys):
    """--speculative suffix runs the workload without and with it: the same tokens generated, fewer forwards per
    token in the tail, and the recompute figures still agree with the batches' count (rejected drafts are not
    recomputed tokens)."""
    flags = ["--model", "tiny", "--num-prompts", "2", "--n", "4", "--median-tokens", "40", "--max-tokens", "120"]
    flags += ["--prompt-tokens", "8", "24", "--cache-fraction", "0.6", "--known-lengths", "--entropy", "0.1"]
    cli.main(["long-tail", *flags, "--speculative", "suffix"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    without, drafted = summary["without"], summary["with"]
    assert any(line.startswith("tail forwards / token") for line in lines)
    assert drafted["generated_tokens"] == without["generated_tokens"] == drafted["tokens_to_generate"]
    assert without["tail_forwards_per_token"] == 1.0 > drafted["tail_forwards_per_token"]
    assert drafted["accepted_draft_tokens"] > 0 and drafted["draft_tokens"] >= drafted["accepted_draft_tokens"]
    # The tail's steps by kind: none drafted without speculation; their periods add up to less than the run
    assert without["tail_drafted_steps"] == 0 and without["tail_drafted_step_ms"] is None
    assert without["tail_plain_steps"] == without["tail_steps"]
    assert (
        drafted["tail_drafted_steps"] > 0
        and drafted["tail_plain_steps"] + drafted["tail_drafted_steps"] == drafted["tail_steps"]
    )
    for run in (without, drafted):
        tail_s = run["tail_ms_per_token"] * run["tail_tokens"] / 1000
        assert 0 < tail_s < run["wall_s"]
    for run in (without, drafted):
        assert run["recomputed_tokens"] == run["recomputed_tokens_by_position"] >= 0
        assert run["device"] == "cpu"
        assert 0 < run["host_s"] < run["wall_s"] / 2  # the tiny model's forward is most of a CPU's step
    assert any(line.startswith("engine host time (s)") for line in lines)
    # gpu-report's speculative section reads this summary: the last sample's speed-up is the medians' ratio
    report = {row.figure: row for row in rows([SectionResult("speculative", "speculative", "ok", 1.0, data=summary)])}
    medians = summary["medians"]["last_finish_s"]
    assert report["the round's last sample, sooner by"].value == medians["without"] / medians["with"]
    assert report["tail forwards per generated token, with drafts"].value == drafted["tail_forwards_per_token"]
    assert report[f"draft tokens accepted (of {drafted['draft_tokens']})"].value == drafted["accepted_draft_tokens"]


def test_the_side_by_side_runs_stay_inside_their_time_budget():
    """--time-budget with --speculative covers every run: each is told what is left, and a pair starts only while
    the time left is at least what the pair before took; a figure no run has (a GPU's host time) stays None."""
    import time

    from rollout.benchmarks.grpo.long_tail_speculative import FIGURES, compare

    told = []

    def measure_one(speculative, time_budget_s):
        told.append(time_budget_s)
        time.sleep(0.2)
        return dict.fromkeys(FIGURES, 2.0 if speculative else 4.0) | {"host_s": None, "finished": True}

    summary = compare(measure_one, "suffix", repeats=5, time_budget_s=0.7)
    assert (summary["repeats"], summary["repeats_asked"], len(told)) == (1, 5, 2)
    assert 0.3 < told[0] <= 0.35 and 0.4 < told[1] <= 0.5  # the plain run half of it, the drafted one the rest
    assert summary["ratios"]["last_finish_s"] == 0.5 and summary["medians"]["host_s"] == {"without": None, "with": None}
    assert summary["ratios"]["host_s"] is None

    def cut_short(speculative, time_budget_s):  # the drafted run did not finish: nothing compares
        return dict.fromkeys(FIGURES, 2.0) | {"finished": not speculative}

    summary = compare(cut_short, "suffix", repeats=1)
    assert summary["repeats_finished"] == 0 and set(summary["ratios"].values()) == {None}


def test_drafts_only_in_steps_decoding_at_most_the_threshold():
    """--speculative-disable-by-batch-size reaches the engine: at 1, only steps that decode one sample draft."""
    shape = Shape(num_prompts=2, n=4, median_tokens=40, max_tokens=120, prompt_tokens=(8, 24))
    prompts, lengths = make_workload(shape, seed=0, vocab=1023)
    runs = {
        size: measure(prompts, lengths, model="tiny", cache_fraction=0.6, progress=False, speculative="suffix",
                      entropy=0.1, known_lengths=True, speculative_disable_by_batch_size=size)
        for size in (1, 8)
    }  # fmt: skip
    assert runs[1]["generated_tokens"] == runs[8]["generated_tokens"] == runs[8]["tokens_to_generate"]
    assert 0 < runs[1]["draft_tokens"] < runs[8]["draft_tokens"]


def test_the_nano_model_runs_in_bf16_with_its_own_vocabulary(monkeypatch):
    """--model nano (a GPU's Qwen3-0.6B architecture) on a CPU, its architecture swapped for a small one: built in
    bf16 from the config, its prompts and stop token from its own vocabulary, and drafts accepted at low entropy."""
    from rollout.benchmarks.grpo import long_tail_workload

    small = {**long_tail_workload.NANO_CONFIG, "vocab_size": 500, "hidden_size": 64, "intermediate_size": 128}
    small.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(long_tail_workload, "NANO_CONFIG", small)
    built = []
    build = long_tail_workload.build_model
    monkeypatch.setattr(long_tail, "build_model", lambda *args: built.append(build(*args)) or built[-1])
    shape = Shape(num_prompts=2, n=4, median_tokens=40, max_tokens=120, prompt_tokens=(8, 24))
    prompts, lengths = make_workload(shape, seed=0, vocab=long_tail_workload.vocab_size("nano") - 1)
    summary = measure(prompts, lengths, model="nano", cache_fraction=0.6, progress=False, speculative="suffix",
                      entropy=0.1, known_lengths=True)  # fmt: skip
    (model,) = built
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.vocab_size == 500
    assert summary["finished"] and summary["generated_tokens"] == summary["tokens_to_generate"]
    assert summary["accepted_draft_tokens"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cuda"], "--device cuda needs --model tiny or nano"),
        (["--model", "nano"], "--model nano needs --device cuda"),
        (["--speculative-disable-by-batch-size", "16"], "has no effect without --speculative suffix"),
        (["--repeats", "3"], "--repeats has no effect without --speculative suffix"),
        (["--num-speculative-tokens", "4"], "no effect without --speculative suffix"),  # typed at its default
        (["--repeats", "1"], "--repeats has no effect without --speculative suffix"),
        (["--speculative", "suffix", "--speculative-disable-by-batch-size", "0"], "must be >= 1, got 0"),
        (["--model", "tiny", "--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_device_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["long-tail", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_device_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["long-tail", "--model", "tiny", "--device", "cuda"])
    assert stop.value.code == 2 and "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_known_lengths_recompute_at_most_a_tenth_at_30_percent_of_the_demand():
    """Each sample's max_new_tokens is its length (the scheduler sees it): 16 groups x 4, lognormal lengths with
    median 150, the cache at 30% of peak demand, so requests queue. Recomputed tokens are at most 10% of those
    generated for every seed 0-7 (with the growth ratio alone: 2.2%, 11.6%, 4.2%, 3.4%, 9.5%, 0, 0, 4.7%)."""
    shape = Shape(num_prompts=16, n=4, median_tokens=150, max_tokens=1200, prompt_tokens=(20, 200))
    for seed in range(8):
        prompts, lengths = make_workload(shape, seed=seed, vocab=STUB_VOCAB - 1)
        summary = measure(prompts, lengths, cache_fraction=0.3, known_lengths=True, seed=seed, progress=False)
        assert summary["finished"] and summary["samples_off_length"] == 0 and summary["queued_steps"] > 0
        assert summary["recompute_ratio"] <= 0.10, (seed, summary["recompute_ratio"])


def test_tail_tokens_are_counted_per_step_with_overlapped_scheduling_too(monkeypatch):
    """With overlapped scheduling (a GPU's default) a step resolves after the next one is scheduled: its tokens still
    count for its own tail step, so a plain run sees exactly one forward per tail token, as without overlap."""
    import functools

    from rollout.benchmarks.grpo import long_tail
    from rollout.config import ContinuousBatchingConfig

    shape = Shape(num_prompts=4, n=4, median_tokens=40, max_tokens=120, prompt_tokens=(16, 64))
    prompts, lengths = make_workload(shape, seed=0, vocab=1023)
    runs = {}
    for overlap in (False, True):
        made = functools.partial(ContinuousBatchingConfig, overlap_scheduling=overlap)
        monkeypatch.setattr(long_tail, "ContinuousBatchingConfig", made)
        runs[overlap] = measure(prompts, lengths, model="tiny", cache_fraction=2.0, progress=False, known_lengths=True)
    assert runs[True]["tail_steps"] == runs[False]["tail_steps"] > 0
    assert runs[True]["tail_tokens"] == runs[False]["tail_tokens"]
    assert runs[True]["tail_forwards_per_token"] == runs[False]["tail_forwards_per_token"] == 1.0

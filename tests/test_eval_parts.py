"""`rollout-eval`'s parts against references: `--batch-config` against the config's own fields, the Wilson interval
against Newcombe's published values, pass@k against the brute force over every k-subset, percentiles against numpy,
the numeric metric on GSM8K-style answers, and the comparison's verdict on generate's own scores."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rollout.cli.batch_config_flags import batch_config_from_pairs
from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.eval.compare import _agreement
from rollout.eval.metrics import numeric
from rollout.eval.stats import mean_interval, pass_at_k, percentile, wilson_interval


def test_batch_config_pairs_read_as_their_fields_types():
    config = batch_config_from_pairs(
        ["num_blocks=64", "max_memory_percent=none", "scheduler_type=prefill_first", "overlap_scheduling=off"]
        + ["attention_backend=torch", "max-batch-tokens=512", "fp32_logits=true"],
        seed=3,
    )
    assert config == ContinuousBatchingConfig(
        num_blocks=64,
        max_memory_percent=None,
        scheduler_type="prefill_first",
        overlap_scheduling=False,
        attention_backend="torch",
        max_batch_tokens=512,
        fp32_logits=True,
        seed=3,
    )
    with pytest.raises(FieldError, match="scheduler_type"):  # the config's own validation still applies
        batch_config_from_pairs(["scheduler_type=lifo"])
    # The field is transformers' name for a fraction: a percent is refused saying so ("must be in (0, 1]" alone left
    # a user who wrote 90, as rollout-worker --max-memory-percent takes it, to guess).
    with pytest.raises(FieldError, match=r"max_memory_percent: 90.0 is invalid: .*a fraction: 0.9 for 90%"):
        batch_config_from_pairs(["max_memory_percent=90"])
    with pytest.raises(FieldError, match="max_memory_percent: has no effect with num_blocks"):  # (it was ignored)
        batch_config_from_pairs(["num_blocks=64", "max_memory_percent=0.5"])
    with pytest.raises(FieldError, match="decode_compile_config: is not a ContinuousBatchingConfig field settable"):
        batch_config_from_pairs(["decode_compile_config=x"])
    # A retired field is refused by name, on the command line and in code.
    with pytest.raises(FieldError, match="previous_paths: is not a ContinuousBatchingConfig field"):
        batch_config_from_pairs(["previous_paths=fp32_head"])
    with pytest.raises(TypeError, match="previous_paths"):
        ContinuousBatchingConfig(previous_paths=("fp32_head",))


def test_wilson_interval_matches_newcombes_published_values():
    """Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (score)."""
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson_interval(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0  # exactly, not 2.8e-17 off


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


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
    for correct in range(n + 1):
        flags = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(flags, k))
            assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_the_interval_over_prompts_never_collapses():
    """All prompts at 0, all at 1, or a single prompt: a bootstrap or normal interval is a point there; this one is
    Wilson's over the prompts, and it contains the mean."""
    assert mean_interval([0.0] * 5) == pytest.approx(wilson_interval(0, 5))
    assert mean_interval([0.0] * 5)[1] > 0.4
    assert mean_interval([1.0] * 5)[0] < 0.6
    low, high = mean_interval([0.125])
    assert low < 0.125 < high and high - low > 0.5
    low, high = mean_interval([0.25, 0.5, 0.75, 1.0])
    assert low < 0.625 < high


def test_a_divergence_is_a_near_tie_only_within_rounding_of_generates_best_score():
    logits = [torch.tensor([[0.0, 10.0, 10.0, 3.0]])]
    step = torch.finfo(torch.bfloat16).eps * 8  # the bf16 spacing at 10
    tie = _agreement(0, [2], [1], [logits[0]], logits, torch.bfloat16)
    assert tie.logit_gap == 0 and tie.rounding_step == step and tie.near_tie
    assert "a near tie: rounding, not a bug" in tie.describe()
    real = _agreement(0, [3], [1], [logits[0]], logits, torch.bfloat16)
    assert real.logit_gap == 7 and not real.near_tie and "not a tie: check the model's code" in real.describe()
    backwards = _agreement(0, [1], [3], [logits[0]], logits, torch.bfloat16)  # generate took a lower score
    assert backwards.logit_gap == -7 and not backwards.near_tie and "did not pick its own best" in backwards.describe()
    banned = _agreement(0, [1], [2], [torch.tensor([[0.0, -float("inf"), 10.0, 3.0]])], logits, torch.bfloat16)
    assert banned.logit_gap == float("inf") and not banned.near_tie

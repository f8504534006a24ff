"""`rollout-eval`'s statistics: accuracy and pass@k with 95% intervals, and length percentiles."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Two-sided 95% normal quantile.
Z95 = 1.959963984540054


def wilson_interval(successes: float, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sound at 0 and 1 successes, unlike the normal one).

    Args:
        successes: correct samples (a sum of values in [0, 1] for `mean_interval`).
        trials: samples (at least 1).
        z: the normal quantile (default: 95%).
    """
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    # At 0 (or all) successes the bound is exactly 0 (or 1); computed, it is off by a rounding (2.8e-17).
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    return low, 1.0 if successes >= trials else min(1.0, centre + half)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate of one prompt (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code"): the probability that k of its n samples, drawn without replacement, hold at least one correct one.

    Args:
        n: samples of the prompt.
        correct: how many of them are correct.
        k: 1 <= k <= n.
    """
    if n - correct < k:
        return 1.0
    # 1 - C(n - c, k) / C(n, k), as a product (no huge binomials).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """A 95% interval of the mean of values in [0, 1], one per independent unit (a prompt: its samples are not
    independent of each other): Wilson's interval with one trial per value at the values' mean.

    A value in [0, 1] with mean p has a variance of at most p (1 - p), a Bernoulli's, so the interval is at least as
    wide as the mean's true one (conservative), and it stays sound where a bootstrap or a normal interval collapses to
    a point: every value 0 or 1, or a single prompt.
    """
    return wilson_interval(sum(values), len(values), z)


def ks_to_report(n: int) -> list[int]:
    """The k of pass@k reported for n samples per prompt: 1, the powers of two below n, and n."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + [n] if n > 1 else ks


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

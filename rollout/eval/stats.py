"""`rollout-eval`'s statistics: accuracy and pass@k with 95% intervals, and length percentiles."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

# Two-sided 95% normal quantile.
Z95 = 1.959963984540054
# Bootstrap resamples of the prompts for pass@k's interval, and their seed (the same rows give the same interval).
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sound at 0 and 1 successes, unlike the normal one).

    Args:
        successes: correct samples.
        trials: samples (at least 1).
        z: the normal quantile (default: 95%).
    """
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


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


def bootstrap_interval(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of `values` (one value per prompt: prompts are the
    independent units, a prompt's samples are not)."""
    rng = random.Random(BOOTSTRAP_SEED)
    count = len(values)
    means = sorted(sum(rng.choices(values, k=count)) / count for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[int(math.ceil(0.975 * (resamples - 1)))]


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

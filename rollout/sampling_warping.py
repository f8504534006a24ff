"""Which `SamplingParams` fields shape the distribution a sample is drawn from, and the values that leave it as it
is: under `do_sample=False` (a greedy pick) any other value would do nothing, so it is refused by name (a sampling
map, a per-request keyword) instead of ignored. The temperature is the exception under
`logprob_mode="temperature_scaled"`: the returned log-probs are scaled by it, greedy or not.
"""

from __future__ import annotations

from typing import Any

# Fields that shape the distribution sampled from (nothing where do_sample is False), and the values with which they
# leave it as it is (temperature 0 is greedy anyway).
NEUTRAL_WARPING = {
    "temperature": (0, 1),
    "top_k": (None, 0),
    "top_p": (None, 1),
    "min_p": (None, 0),
    "typical_p": (None, 1),
    "epsilon_cutoff": (None, 0),
    "eta_cutoff": (None, 0),
}


def warping_fields(fields: dict[str, Any], logprob_mode: Any = None) -> list[str]:
    """The fields of `fields` that would shape the sampled distribution (sorted): what a greedy pick ignores.

    Args:
        fields: SamplingParams fields by name.
        logprob_mode: the request's logprob_mode (None: the one in `fields`, if any); under "temperature_scaled"
            the temperature scales the returned log-probs, so it is not among them.
    """
    mode = fields.get("logprob_mode") if logprob_mode is None else logprob_mode
    ignored = {name for name in set(fields) & set(NEUTRAL_WARPING) if fields[name] not in NEUTRAL_WARPING[name]}
    return sorted(ignored - ({"temperature"} if mode == "temperature_scaled" else set()))

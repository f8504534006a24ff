"""The long-tail shape of `rollout-bench grpo-step --partial-rollouts`: the main job's GRPO steps on the real tiny
model with reasoning-like output lengths. Each group gets its own length, lognormal (median `MEDIAN_TOKENS`, sigma
`SIGMA`, capped at `CAP_TOKENS`), forced: EOS is banned until that length (min_new_tokens) and it is the group's
max_new_tokens, so every sample of the group generates exactly that many tokens. The length depends only on the
prompt's token ids and the seed, so every system compared draws the same lengths for the same prompts.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import replace
from typing import Any

MEDIAN_TOKENS, SIGMA, CAP_TOKENS = 32, 1.0, 256


def group_length(prompt_ids: list[int], seed: int = 0) -> int:
    """The forced length of the group of this prompt: lognormal, the same for the same prompt and seed."""
    digest = hashlib.blake2b(repr((seed, list(prompt_ids))).encode(), digest_size=8).digest()
    draw = random.Random(int.from_bytes(digest, "big")).lognormvariate(math.log(MEDIAN_TOKENS), SIGMA)
    return min(CAP_TOKENS, max(1, round(draw)))


def force_lengths(client: Any, seed: int = 0) -> None:
    """Make every group `client` sends generate exactly `group_length` tokens per sample (wraps its submit; the
    trainer's own sampling settings are otherwise unchanged).

    Args:
        client: the trainer's RolloutClient.
        seed: the lengths' seed.
    """
    submit = client._submit  # noqa: SLF001 - every generation path of the trainer goes through it

    def submit_with_length(group: Any, stream: bool, sink: Any = None) -> Any:
        length = group_length(group.prompt_ids, seed)
        sampling = {**dict(group.sampling), "max_new_tokens": length, "min_new_tokens": length}
        return submit(replace(group, sampling=sampling), stream, sink)

    client._submit = submit_with_length  # noqa: SLF001

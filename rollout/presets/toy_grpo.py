"""The main job's task, a toy GRPO run that needs no download (examples/grpo_toy.py, `rollout-bench grpo-step`):
letters-only completions of random prompts, rewarded by the fraction of lowercase letters."""

from __future__ import annotations

import functools
import string
from typing import Any

from rollout.presets.models import tiny_tokenizer


def toy_grpo_config(output_dir: str, max_steps: int, use_cpu: bool = True, **overrides: Any) -> Any:
    """The main job's `trl.GRPOConfig`: 16 rows of 8 samples per step, 16 new tokens, temperature 1, fp32 (the
    trainer's logprobs then match rollout's: see the sampling/* metrics).

    Args:
        output_dir: the trainer's output folder.
        max_steps: training steps.
        use_cpu: train on the CPU.
        **overrides: other GRPOConfig fields.
    """
    from trl import GRPOConfig

    settings = dict(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        learning_rate=3e-3,
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=use_cpu,
        bf16=False,
        seed=0,
    )
    return GRPOConfig(**{**settings, **overrides})


def toy_prompts(count: int = 256, seed: int = 0) -> list[str]:
    """The letters-only task's prompts: 8 random letters and digits, then ": ".

    Args:
        count: how many prompts.
        seed: their random seed (the same prompts for the same seed).
    """
    import random

    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters + string.digits, k=8)) + ": " for _ in range(count)]


def letter_reward(completion_ids: list[list[int]], **columns: object) -> list[float]:
    """The letters-only task's reward (a TRL reward function): the fraction of a completion's tokens that are
    lowercase letters in `tiny_tokenizer()`'s vocabulary (its EOS does not count). An untrained tiny model scores
    about 0.03.

    Args:
        completion_ids: each completion's token ids (TRL passes them by this name).
        **columns: the other columns TRL passes (prompts, completions, ...), unused.
    """
    letters, eos = _letter_ids()
    rewards = []
    for ids in completion_ids:
        ids = [t for t in ids if t != eos]
        rewards.append(sum(t in letters for t in ids) / max(len(ids), 1))
    return rewards


@functools.cache
def _letter_ids() -> tuple[frozenset[int], int]:
    """(the lowercase letters' token ids, the EOS id) of `tiny_tokenizer()`."""
    tokenizer = tiny_tokenizer()
    return frozenset(tokenizer.convert_tokens_to_ids(c) for c in string.ascii_lowercase), tokenizer.eos_token_id

"""What the TRL tests and their child processes (2-rank runs) share: the GRPO settings, dataset and reward of
their small runs."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

PROMPTS = [f"q{i:02d} say: " for i in range(32)]


def id_reward(completion_ids: list[list[int]], **_: object) -> list[float]:
    """A reward that differs between almost any two completions (so every group has a non-zero advantage)."""
    return [sum(ids) / (1024 * max(len(ids), 1)) for ids in completion_ids]


def reward_failing_on_call(number: int):
    """`id_reward`, raising RuntimeError("reward server down") at its `number`-th call (a failing training step)."""
    calls = []

    def reward(completion_ids: list[list[int]], **kwargs: object) -> list[float]:
        calls.append(1)
        if len(calls) == number:
            raise RuntimeError("reward server down")
        return id_reward(completion_ids, **kwargs)

    return reward


def grpo_config(tmp_path: Path, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS})

"""`rollout-eval --compare-with-generate K`: transformers' own `generate` on the first K prompts, greedy, same model
and dtype, token by token against rollout's completions: what a model developer checks after changing a model's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm


@dataclass
class PromptAgreement:
    """How one prompt's rollout completion compares with transformers' `generate`.

    Attributes:
        prompt_index: the prompt's row in the dataset.
        rollout_tokens: rollout's completion (token ids).
        generate_tokens: `generate`'s completion (token ids).
        agreement: positions where both hold the same token, over the longer completion's length (1.0 when equal).
        first_divergence: the first position where they differ (or where the shorter ended); None when equal.
    """

    prompt_index: int
    rollout_tokens: list[int]
    generate_tokens: list[int]
    agreement: float
    first_divergence: int | None

    @classmethod
    def of(cls, prompt_index: int, rollout_tokens: list[int], generate_tokens: list[int]) -> PromptAgreement:
        """Compare two completions of prompt `prompt_index`."""
        longer = max(len(rollout_tokens), len(generate_tokens))
        same = sum(a == b for a, b in zip(rollout_tokens, generate_tokens))
        divergence = next(
            (i for i, (a, b) in enumerate(zip(rollout_tokens, generate_tokens)) if a != b),
            None if len(rollout_tokens) == len(generate_tokens) else min(len(rollout_tokens), len(generate_tokens)),
        )
        return cls(prompt_index, rollout_tokens, generate_tokens, same / longer if longer else 1.0, divergence)

    def describe(self) -> str:
        """One line: where the two completions part, and with which tokens."""
        if self.first_divergence is None:
            return f"prompt {self.prompt_index}: identical ({len(self.rollout_tokens)} tokens)"
        at = self.first_divergence

        def token(tokens: list[int]) -> str:
            return str(tokens[at]) if at < len(tokens) else "end"

        return (
            f"prompt {self.prompt_index}: first divergence at token {at} (rollout {token(self.rollout_tokens)}, "
            f"generate {token(self.generate_tokens)}), agreement {self.agreement:.1%}"
        )


def greedy_generate(
    model: torch.nn.Module, prompts: Sequence[list[int]], generation_config: Any, progress_bar: bool = True
) -> list[list[int]]:
    """transformers' `generate`, one prompt at a time (no padding to differ by), greedy, with `generation_config`
    (the one rollout ran with, so the same max_new_tokens, stop tokens and processors apply).

    Args:
        model: the model rollout ran (same weights, same dtype, same device).
        prompts: token ids of each prompt.
        generation_config: a `transformers.GenerationConfig` with do_sample=False.
        progress_bar: show a tqdm bar over the prompts.
    Returns:
        Each prompt's generated token ids, up to and including a stop token, as rollout returns them.
    """
    device = next(model.parameters()).device
    stops = _stop_ids(generation_config, model)
    completions = []
    for prompt in tqdm(prompts, disable=not progress_bar, desc="generate (reference)", unit="prompt"):
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                generation_config=generation_config,
            )
        tokens = output[0, len(prompt) :].tolist()
        end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
        completions.append(tokens[:end])  # generate pads nothing for one prompt, but cut at the stop to be sure
    return completions


def _stop_ids(generation_config: Any, model: torch.nn.Module) -> set[int]:
    """The token ids that end generation (the config's eos_token_id, else the model's)."""
    eos = generation_config.eos_token_id
    if eos is None:
        eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)

"""`rollout-eval --compare-with-generate K`: transformers' own `generate` on the first K prompts, greedy, same model
and dtype, token by token against rollout's completions: what a model developer checks after changing a model's code.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.engine.progress import QuietBar


@dataclass
class PromptAgreement:
    """How one prompt's rollout completion compares with transformers' `generate`.

    Attributes:
        prompt_index: the prompt's row in the dataset.
        rollout_tokens: rollout's completion (token ids).
        generate_tokens: `generate`'s completion (token ids).
        agreement: positions where both hold the same token, over the longer completion's length (1.0 when equal).
        first_divergence: the first position where they differ (or where the shorter ended); None when equal.
        logit_gap: at the first divergence (when both have a token there), `generate`'s score of its own token minus
            its score of rollout's token, in the scores greedy decoding takes the argmax of (the logits after
            generate's processors): 0 is an exact tie, a few rounding steps a near tie, infinite when a processor
            ruled rollout's token out; negative only if generate did not pick its own argmax.
        rounding_step: the spacing of the model dtype's numbers at the magnitude of generate's raw logit there (one
            unit in the last place), the scale `logit_gap` is judged on.
    """

    prompt_index: int
    rollout_tokens: list[int]
    generate_tokens: list[int]
    agreement: float
    first_divergence: int | None
    logit_gap: float | None = None
    rounding_step: float | None = None

    @property
    def near_tie(self) -> bool:
        """Whether the divergence is one `generate`'s own logits barely decide: the two tokens' logits at most
        `NEAR_TIE_STEPS` rounding steps apart, where the engine's and transformers' kernels may round either way."""
        if self.logit_gap is None or self.rounding_step is None:
            return False
        return 0.0 <= self.logit_gap <= NEAR_TIE_STEPS * self.rounding_step

    def describe(self) -> str:
        """One line: where the two completions part, with which tokens, and how close generate's call was."""
        if self.first_divergence is None:
            return f"prompt {self.prompt_index}: identical ({len(self.rollout_tokens)} tokens)"
        at = self.first_divergence

        def token(tokens: list[int]) -> str:
            return str(tokens[at]) if at < len(tokens) else "end"

        line = (
            f"prompt {self.prompt_index}: first divergence at token {at} (rollout {token(self.rollout_tokens)}, "
            f"generate {token(self.generate_tokens)}), agreement {self.agreement:.1%}"
        )
        if self.logit_gap is not None:
            if self.near_tie:
                verdict = "a near tie: rounding, not a bug"
            elif self.logit_gap < 0:
                verdict = "generate did not pick its own best score: check its processors"
            else:
                verdict = "not a tie: check the model's code"
            line += f"; generate's scores for the two differ by {self.logit_gap:.4g} ({verdict})"
        return line


# A divergence where generate's logits for the two tokens are at most this many rounding steps apart is a near tie.
NEAR_TIE_STEPS = 2


def compare_with_generate(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    rollout_completions: Sequence[list[int]],
    generation_config: Any,
    progress_bar: bool = True,
    tokenizer: Any = None,
) -> list[PromptAgreement]:
    """transformers' `generate`, one prompt at a time (no padding to differ by), greedy, with `generation_config`
    (the one rollout ran with, so the same max_new_tokens, stop tokens and processors apply), compared token by
    token with rollout's completions; at a divergence, generate's own logits say how close its choice was.

    Args:
        model: the model rollout ran (same weights, same dtype, same device).
        prompts: token ids of each prompt.
        rollout_completions: rollout's completion of each prompt.
        generation_config: a `transformers.GenerationConfig` with do_sample=False.
        progress_bar: show a tqdm bar over the prompts.
        tokenizer: the model's tokenizer, which `generate` needs for stop strings (the config's or the model's own
            `stop_strings`), as rollout does.
    """
    device = next(model.parameters()).device
    stops = _stop_ids(generation_config, model)
    generation_config = copy.deepcopy(generation_config)  # asked to return the scores too, the caller's untouched
    generation_config.update(output_logits=True, output_scores=True, return_dict_in_generate=True)
    agreements = []
    bar = QuietBar(prompts, disable=not progress_bar, desc="generate (reference)", unit="prompt")
    for index, (prompt, ours) in enumerate(zip(bar, rollout_completions)):
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                generation_config=generation_config,
                tokenizer=tokenizer,
            )
        tokens = output.sequences[0, len(prompt) :].tolist()
        end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
        agreements.append(_agreement(index, ours, tokens[:end], output.scores, output.logits, model.dtype))
    return agreements


def _agreement(
    index: int,
    ours: list[int],
    theirs: list[int],
    scores: Sequence[torch.Tensor],
    logits: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> PromptAgreement:
    """Compare two completions of prompt `index`; `scores` are generate's processed scores of each step (what its
    greedy argmax reads), `logits` its raw logits."""
    longer = max(len(ours), len(theirs))
    same = sum(a == b for a, b in zip(ours, theirs))
    divergence = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
        None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
    )
    agreement = PromptAgreement(index, ours, theirs, same / longer if longer else 1.0, divergence)
    if divergence is not None and divergence < min(len(ours), len(theirs)):
        step = scores[divergence][0].float()
        agreement.logit_gap = float(step[theirs[divergence]] - step[ours[divergence]])
        magnitude = max(abs(float(logits[divergence][0, theirs[divergence]])), torch.finfo(dtype).tiny)
        agreement.rounding_step = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
    return agreement


def _stop_ids(generation_config: Any, model: torch.nn.Module) -> set[int]:
    """The token ids that end generation (the config's eos_token_id, else the model's)."""
    eos = generation_config.eos_token_id
    if eos is None:
        eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)

"""`rollout-eval`'s run: prompts tokenized, `generate_batch` over them (warm-up untimed), one row per sample scored."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rollout.engine.generate import generate_batch, release_cached_engine
from rollout.eval.metrics import Metric, score


class PromptError(ValueError):
    """A dataset row whose prompt cannot be fed to the model; the message names the row and the flag."""


@dataclass
class Generated:
    """What the timed `generate_batch` call produced.

    Attributes:
        rows: one dict per sample, in prompt order then sample order (the JSONL rows).
        prompt_ids: the token ids of each prompt.
        seconds: wall time of the timed call (the engine built and warmed up before it).
        warmup_seconds: building the engine and its warm-up request, not in `seconds`.
    """

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    seconds: float
    warmup_seconds: float

    @property
    def output_tokens(self) -> int:
        """Generated tokens over all samples."""
        return sum(len(row["token_ids"]) for row in self.rows)


def tokenize_prompts(tokenizer: Any, prompts: list[Any], chat: bool, prompt_field: str) -> list[list[int]]:
    """Each prompt as token ids: as the tokenizer encodes it, or with `chat` rendered by the tokenizer's chat
    template as a user turn (a prompt that already is a list of {"role", "content"} messages is rendered as is),
    with the assistant's turn opened.

    Raises:
        PromptError: an empty or missing prompt, or a message list without --chat.
    """
    encoded = []
    for index, prompt in enumerate(prompts):
        if prompt is None or prompt == "" or prompt == []:
            raise PromptError(f"--prompt-field {prompt_field}: row {index} has an empty prompt")
        if chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            encoded.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        elif isinstance(prompt, (list, dict)):
            raise PromptError(
                f"--prompt-field {prompt_field}: row {index} holds a {type(prompt).__name__}, not text; pass --chat to "
                "render chat messages with the tokenizer's chat template"
            )
        else:
            encoded.append(tokenizer(str(prompt))["input_ids"])
    return encoded


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    generation_config: Any,
    batch_config: Any,
    n: int,
    progress_bar: bool = True,
) -> Generated:
    """Run `generate_batch` over the prompts, n samples each; the engine is built and warmed up by a one-token
    request first, outside the timing, and released at the end.

    Args:
        model: the model.
        tokenizer: its tokenizer (completions are decoded with it, special tokens skipped).
        prompt_ids: the tokenized prompts.
        generation_config: the sampling settings (a `transformers.GenerationConfig`, merged with the model's own).
        batch_config: the engine's `ContinuousBatchingConfig`.
        n: samples per prompt.
        progress_bar: show generate_batch's bar.
    """
    started = time.perf_counter()
    try:
        shared = dict(
            generation_config=generation_config, continuous_batching_config=batch_config, persistent_manager=True
        )
        generate_batch(model, prompt_ids[:1], max_new_tokens=1, progress_bar=False, tokenizer=tokenizer, **shared)
        timed = time.perf_counter()
        outputs = generate_batch(model, prompt_ids, n=n, progress_bar=progress_bar, tokenizer=tokenizer, **shared)
        done = time.perf_counter()
    finally:
        release_cached_engine(model)  # the KV cache and graphs go now, not at a garbage collection
    rows = []
    for output in outputs.values():
        prompt_index = int(output.group_id.removeprefix("req_"))
        rows.append(
            dict(
                prompt_index=prompt_index,
                sample_index=output.sample_index,
                completion=tokenizer.decode(output.generated_tokens, skip_special_tokens=True),
                token_ids=list(output.generated_tokens),
                logprobs=[float(logprob) for logprob in output.logprobs],
                finish_reason=output.finish_reason,
            )
        )
    return Generated(rows, prompt_ids, done - timed, timed - started)


def score_rows(rows: list[dict[str, Any]], answers: list[Any], metric: Metric, metric_spec: str) -> None:
    """Set each row's `answer` and `correct` (the metric's verdict on its completion)."""
    for row in rows:
        row["answer"] = answers[row["prompt_index"]]
        row["correct"] = score(metric, metric_spec, row["completion"], row["answer"])

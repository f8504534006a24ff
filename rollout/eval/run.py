"""`rollout-eval`'s run: prompts tokenized, `generate_batch` over them (warm-up untimed), one row per sample scored."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from rollout.cli.hub import first_line
from rollout.engine.generate import (
    GenerationInterrupted,
    SamplesFailedWarning,
    cached_engine,
    generate_batch,
    release_cached_engine,
)
from rollout.eval.metrics import Metric, score


class PromptError(ValueError):
    """A dataset row whose prompt cannot be fed to the model; the message names the row and the flag."""


class SamplesFailed(PromptError):
    """Samples the engine ended with an error; `rows` holds every sample's row (the failed ones with their `error`),
    so that the finished ones are kept."""

    def __init__(self, message: str, rows: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.rows = rows


class SamplesInterrupted(KeyboardInterrupt):
    """Ctrl-C while generating; `rows` holds the rows of the samples finished by then, `total` how many were asked."""

    def __init__(self, rows: list[dict[str, Any]], total: int) -> None:
        super().__init__("interrupted while generating")
        self.rows, self.total = rows, total


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


def tokenize_prompts(
    tokenizer: Any, prompts: list[Any], chat: bool, prompt_field: str, max_chars: int | None = None
) -> list[list[int]]:
    """Each prompt as token ids: text as the tokenizer encodes it (a number as its text), or with `chat` rendered by
    the tokenizer's chat template as a user turn (a prompt that already is a list of {"role", "content"} messages is
    rendered as is), with the assistant's turn opened.

    Args:
        tokenizer: the model's tokenizer.
        prompts: each row's prompt as the dataset holds it.
        chat: render through the chat template.
        prompt_field: the field the prompts came from (named in errors).
        max_chars: the longest prompt tokenized, in characters (a message list: its contents together); a longer
            one is refused before the tokenizer spends minutes and gigabytes on it (None: no limit).
    Raises:
        PromptError: an empty or missing prompt, a list or object without --chat, a malformed message list or one
            ending with an assistant message, messages the chat template refuses (its message), a prompt over
            `max_chars`, or a prompt that encodes to no tokens.
    """
    encoded = []
    for index, prompt in enumerate(prompts):
        if max_chars is not None and _length(prompt) > max_chars:
            raise PromptError(
                f"--prompt-field {prompt_field}: row {index} holds a prompt of {_length(prompt):,} characters, over "
                f"--max-line-chars {max_chars}; shorten or leave out such rows, or raise --max-line-chars"
            )
        missing = isinstance(prompt, float) and math.isnan(prompt)  # how pandas writes a missing value: not "nan"
        if prompt is None or prompt == "" or prompt == [] or missing:
            what = " (NaN, a missing value)" if missing else ""
            raise PromptError(f"--prompt-field {prompt_field}: row {index} has an empty prompt{what}")
        if isinstance(prompt, list) and not chat:
            raise PromptError(
                f"--prompt-field {prompt_field}: row {index} holds a list, not text; pass --chat to render a list of "
                "chat messages with the tokenizer's chat template"
            )
        if isinstance(prompt, (dict, bool)) or not isinstance(prompt, (str, int, float, list)):
            raise PromptError(
                f"--prompt-field {prompt_field}: row {index} holds a {type(prompt).__name__}; a prompt is text, or "
                'with --chat a list of {"role": ..., "content": ...} messages'
            )
        if chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
                raise PromptError(
                    f"--prompt-field {prompt_field}: row {index} is a list but not of chat messages "
                    '({"role": ..., "content": ...} each)'
                )
            for number, message in enumerate(messages):  # null renders as an empty turn: the question is gone
                content = message["content"]
                if message["role"] != "assistant" and (
                    content is None or (isinstance(content, float) and math.isnan(content))
                ):  # (an assistant turn of tool calls alone has none)
                    raise PromptError(
                        f"--prompt-field {prompt_field}: row {index} message {number} ({message['role']}) has no "
                        "content (a missing value), which the chat template would render as an empty turn; fill it "
                        "in or leave the row out"
                    )
            if messages[-1]["role"] == "assistant":  # (an SFT row's reply: often the very answer scored against)
                raise PromptError(
                    f"--prompt-field {prompt_field}: row {index} ends with an assistant message, which the chat "
                    "template would render into the prompt, for the model to read, before opening the turn it "
                    "answers in; leave the reply out of the prompt's messages"
                )
            try:  # a template may refuse a conversation (Mistral's: "roles must alternate") with its own message
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as error:
                raise PromptError(
                    f"--prompt-field {prompt_field}: row {index}: the tokenizer's chat template refused its messages "
                    f"({first_line(error)}); fix or leave out such rows"
                ) from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(str(prompt))["input_ids"]
        if not ids:
            raise PromptError(f"--prompt-field {prompt_field}: row {index} encodes to no tokens")
        encoded.append(ids)
    return encoded


def _length(prompt: Any) -> int:
    """A prompt's length in characters: its text, or a message list's contents together."""
    if isinstance(prompt, list):
        return sum(len(str(message.get("content", ""))) if isinstance(message, dict) else 0 for message in prompt)
    return len(prompt) if isinstance(prompt, str) else 0


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
    Raises:
        PromptError: a prompt that does not fit the model's context with max_new_tokens (naming its row).
        SamplesFailed: samples the engine ended with an error (its message: e.g. a KV cache too small for one
            request), with every sample's row.
        SamplesInterrupted: Ctrl-C while generating, with the rows of the samples finished by then.
    """
    started = time.perf_counter()
    try:
        shared = dict(
            generation_config=generation_config, continuous_batching_config=batch_config, persistent_manager=True
        )
        generate_batch(model, [prompt_ids[0][:1]], max_new_tokens=1, progress_bar=False, tokenizer=tokenizer, **shared)
        _check_context(cached_engine(model).max_model_len, prompt_ids, generation_config.max_new_tokens)
        timed = time.perf_counter()
        try:  # (the warm-up's outputs, above, are no rows)
            with warnings.catch_warnings():  # failed samples are this function's own error (SamplesFailed), below
                warnings.simplefilter("ignore", SamplesFailedWarning)
                outputs = generate_batch(
                    model, prompt_ids, n=n, progress_bar=progress_bar, tokenizer=tokenizer, **shared
                )
        except GenerationInterrupted as interrupt:  # the samples finished so far are kept
            raise SamplesInterrupted(_rows(tokenizer, interrupt.outputs.values()), len(prompt_ids) * n) from None
        done = time.perf_counter()
    finally:
        release_cached_engine(model)  # the KV cache and graphs go now, not at a garbage collection
    rows = _rows(tokenizer, outputs.values())
    failed = [output for output in outputs.values() if output.finish_reason == "error"]
    if failed:
        raise SamplesFailed(
            f"{len(failed)} of {len(outputs)} samples failed in the engine: {failed[0].error} (engine fields are set "
            "with --batch-config KEY=VALUE)",
            rows,
        )
    return Generated(rows, prompt_ids, done - timed, timed - started)


def _rows(tokenizer: Any, outputs: Any) -> list[dict[str, Any]]:
    """One row per sample output (a failed one's with its `error`)."""
    rows = []
    for output in outputs:
        row = dict(
            prompt_index=int(output.group_id.removeprefix("req_")),
            sample_index=output.sample_index,
            completion=tokenizer.decode(output.generated_tokens, skip_special_tokens=True),
            token_ids=list(output.generated_tokens),
            logprobs=[float(logprob) for logprob in output.logprobs],
            finish_reason=output.finish_reason,
        )
        if output.finish_reason == "error":
            row["error"] = str(output.error)
        rows.append(row)
    return rows


def _check_context(context: int, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """Every prompt leaves room for max_new_tokens in the model's context (else a PromptError naming the row)."""
    for index, prompt in enumerate(prompt_ids):
        if len(prompt) + max_new_tokens > context:
            raise PromptError(
                f"row {index}: its prompt ({len(prompt)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                f"model's context of {context} tokens; leave out or shorten such rows, or lower --max-new-tokens"
            )


def score_rows(rows: list[dict[str, Any]], answers: list[Any], metric: Metric, metric_spec: str) -> None:
    """Set each row's `answer` and `correct` (the metric's verdict on its completion).

    Raises:
        MetricError: the metric raised or gave no verdict on a row (named); rows scored before it keep theirs.
    """
    for row in rows:
        row["answer"] = answers[row["prompt_index"]]
        row["correct"] = score(metric, metric_spec, row["completion"], row["answer"], row["prompt_index"])

"""/v1/completions' `echo` and vLLM's `prompt_logprobs`: the prompt returned with the answer, and each prompt
token's log-prob given the tokens before it, computed by the engine in the prefill forward (`SamplingParams.
prompt_logprobs`). lm-evaluation-harness's loglikelihood tasks send `echo=true, logprobs=1, max_tokens=0 or 1` and
read the prompt's part of `logprobs.token_logprobs` and `top_logprobs`; `max_tokens=0` scores without generating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.sampling_params import MAX_SERVED_LOGPROBS
from rollout.service.http.api import openai_fields as fields
from rollout.service.http.api.choices import Choice, LogprobFormat


@dataclass(frozen=True)
class PromptScoring:
    """What a completions request asks of its prompts.

    Attributes:
        echo: return each prompt before its completion (text, and log-probs with `logprobs`).
        prompt_logprobs: vLLM's field: return `prompt_logprobs` per choice with this many top tokens per position
            (None: not asked).
        texts: each prompt as sent (None where it was sent as token ids: echoed as their decoded text).
    """

    echo: bool = False
    prompt_logprobs: int | None = None
    texts: tuple[str | None, ...] = ()

    @classmethod
    def of(cls, body: dict[str, Any]) -> PromptScoring:
        """A completions body's echo and prompt_logprobs fields, checked (a 400 naming a bad one)."""
        prompt = body.get("prompt")
        items = [prompt] if isinstance(prompt, str) or not isinstance(prompt, list) or _is_ids(prompt) else prompt
        texts = tuple(item if isinstance(item, str) else None for item in items)
        top = fields.integer(body, "prompt_logprobs", None, 0, MAX_SERVED_LOGPROBS)
        return cls(fields.flag(body, "echo"), top, texts)

    @property
    def scores_prompts(self) -> bool:
        """The request may score its prompts only (then max_tokens 0 is allowed)."""
        return self.echo or self.prompt_logprobs is not None

    def engine_top(self, logprobs: int | None, max_tokens: int) -> int | None:
        """`SamplingParams.prompt_logprobs` for the request: the most top tokens any answer field needs, 0 to score a
        prompt with no completion, None when nothing needs the prompt's log-probs."""
        wanted = [k for k in (self.prompt_logprobs, logprobs if self.echo else None) if k is not None]
        if wanted:
            return max(wanted)
        return 0 if max_tokens == 0 else None

    def prompt_text(self, choice_prompt: int, prompt_ids: list[int], tokenizer: Any) -> str:
        """The text `echo` returns for prompt number `choice_prompt`."""
        text = self.texts[choice_prompt] if choice_prompt < len(self.texts) else None
        return text if text is not None else tokenizer.decode(prompt_ids)


def echoed_logprobs(format: LogprobFormat, choice: Choice, rest: dict[str, Any], top: int) -> dict[str, Any]:
    """Completions' `logprobs` of an echoed choice: the prompt's entries, then `rest` (the completion's, whose text
    offsets already count the prompt's text)."""
    if choice.prompt_logprobs is None:  # the sample ended before its prompt was scored (its answer is an error)
        return rest
    prompt = format.echoed_prompt(choice, top)
    merged = {name: prompt[name] + rest[name] for name in ("tokens", "token_logprobs", "text_offset")}
    merged["top_logprobs"] = None if prompt["top_logprobs"] is None else prompt["top_logprobs"] + rest["top_logprobs"]
    return merged


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

"""A whole answer's size, bounded before the request starts.

A whole (not streamed) answer is built in memory and encoded at once. Its log-probs grow with the product of the
choices, the tokens and the top alternatives per token, and an echoed prompt's log-probs are repeated in every
choice: a 2,000-token prompt with `prompt_logprobs: 20`, `echo` and `n: 128` builds half a gigabyte. So the most
log-prob entries a request's answer could hold are counted from its fields (the completion at its `max_tokens`) and
a request over the worker's limit is refused by name, before any token is generated. So are answers whose tokens
alone (their text, and token ids when asked) could exceed `MAX_ANSWER_TOKENS`. A streamed answer is sent as it is
made and never held whole: it is not limited.
"""

from __future__ import annotations

from rollout.service.http.api.openai_fields import GenerationRequest
from rollout.service.http.errors import APIError

# Tokens a whole answer may hold: its choices' completions at max_tokens, and the prompts it repeats in every choice
# (echo, return_token_ids). About 40 bytes each while built: 2^22 bound an answer to about 170 MB.
MAX_ANSWER_TOKENS = 1 << 22


def most_logprob_entries(request: GenerationRequest) -> dict[str, int]:
    """The most log-prob entries each field of a request could put in its whole answer (an entry: one token's
    log-prob, or one of its top alternatives), by the field that asked for them."""
    choices, top = len(request.prompts) * request.n, request.logprobs
    prompt_tokens = request.n * sum(len(prompt) for prompt in request.prompts)
    entries = {"logprobs": 0, "echo": 0, "prompt_logprobs": 0}
    if top is not None:
        entries["logprobs"] = choices * request.sampling.max_new_tokens * (top + 1)
    scoring = request.scoring
    if scoring is not None and scoring.echo and top is not None:
        entries["echo"] = prompt_tokens * (top + 1)
    if scoring is not None and scoring.prompt_logprobs is not None:
        entries["prompt_logprobs"] = prompt_tokens * (scoring.prompt_logprobs + 1)
    return entries


def check_answer_size(request: GenerationRequest, chat: bool, limit: int) -> None:
    """Refuse a request whose whole answer could hold more than `limit` log-prob entries.

    Args:
        request: the checked request.
        chat: a chat request (its top log-probs field is `top_logprobs`).
        limit: the worker's most entries per whole answer (`HttpSettings.max_answer_logprobs`).

    Raises:
        APIError: 400 naming the field that asked for the most entries.
    """
    if request.stream:
        return
    choices = len(request.prompts) * request.n
    tokens = choices * request.sampling.max_new_tokens
    if request.return_token_ids or (request.scoring is not None and request.scoring.echo):
        tokens += request.n * sum(len(prompt) for prompt in request.prompts)
    if tokens > MAX_ANSWER_TOKENS:
        field = "max_completion_tokens" if chat else "max_tokens"
        reason = (
            f"the answer could hold {tokens} tokens ({len(request.prompts)} prompt(s) x n={request.n} choices of up "
            f"to {request.sampling.max_new_tokens}); a whole answer holds at most {MAX_ANSWER_TOKENS}: stream it "
            f"(stream: true), or set {field} lower"
        )
        raise APIError(400, f"{field}: {reason}", field)
    entries = most_logprob_entries(request)
    total = sum(entries.values())
    if total <= limit:
        return
    field = max(entries, key=entries.__getitem__)
    if field == "logprobs" and chat:
        field = "top_logprobs" if request.logprobs else "logprobs"
    reason = (
        f"the answer could hold {total} log-prob entries ({len(request.prompts)} prompt(s) x n={request.n}); a whole "
        f"answer holds at most {limit} (the worker's --http-max-answer-logprobs): stream it (stream: true), or ask "
        "for fewer choices, tokens or top log-probs"
    )
    raise APIError(400, f"{field}: {reason}", field)

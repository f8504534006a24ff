"""The tokens a request bans by itself, whatever it generated (`always_banned`: suppress_tokens and single-token
bad_words_ids), and at its first position (`first_token_bans`: begin_suppress_tokens, its stop tokens while
`min_new_tokens` masks them, and what its prompt's last tokens ban through no_repeat_ngram_size and multi-token
bad_words_ids): the intake refuses a request they leave nothing to draw from (`check_first_token`)
before it runs. The sampler's masks are built from the same lists (`rollout.engine.sampling.ban_lists`)."""

from __future__ import annotations

from rollout.config import FieldError
from rollout.engine.requests.request import Request


def always_banned(request: Request) -> list[int]:
    """Sorted token ids the request never generates: suppress_tokens and single-token bad words, except that a
    single-token bad word that is a stop token is kept allowed, as transformers does."""
    params = request.sampling
    single = [w[0] for w in params.bad_words_ids if len(w) == 1 and w[0] not in request.stop_token_ids]
    return sorted(set(params.suppress_tokens).union(single))


def first_token_bans(request: Request) -> tuple[set[int], list[str]]:
    """The token ids the request may not generate as its first token, and the fields that ban them (stop tokens while
    `min_new_tokens` masks them, suppress_tokens, bad_words_ids, begin_suppress_tokens, no_repeat_ngram_size over
    the prompt): the intake refuses a request they leave nothing to draw from, before it runs."""
    params = request.sampling
    banned, fields = set(always_banned(request)), []
    if params.suppress_tokens:
        fields.append("suppress_tokens")
    if any(len(word) == 1 for word in params.bad_words_ids):
        fields.append("bad_words_ids")
    if params.begin_suppress_tokens:
        banned.update(params.begin_suppress_tokens)
        fields.append("begin_suppress_tokens")
    if params.min_new_tokens and request.stop_token_ids:
        banned.update(request.stop_token_ids)
        fields[:0] = ["stop_token_ids", "min_new_tokens"]
    prompt = request.token_ids[: request.num_prompt_tokens]
    completed = [word[-1] for word in params.bad_words_ids if len(word) > 1 and _ends_with(prompt, word[:-1])]
    if completed:  # a multi-token bad word the prompt's last tokens begin
        banned.update(completed)
        fields.append("bad_words_ids")
    size = params.no_repeat_ngram_size
    if size and len(prompt) >= size:  # the n-grams the prompt holds, as transformers counts them (prompt included)
        prefix = prompt[len(prompt) - size + 1 :]
        banned.update(
            prompt[start + size - 1]
            for start in range(len(prompt) - size + 1)
            if prompt[start : start + size - 1] == prefix
        )
        fields.append("no_repeat_ngram_size")
    return banned, list(dict.fromkeys(fields))


def _ends_with(tokens: list[int], suffix: tuple[int, ...] | list[int]) -> bool:
    return len(tokens) >= len(suffix) and tuple(tokens[len(tokens) - len(suffix) :]) == tuple(suffix)


def check_first_token(request: Request, vocab_size: int) -> None:
    """Refuse a request whose bans leave no token to draw first (the engine would end it with an error).

    Args:
        request: a request as the intake prepared it (its stop tokens resolved).
        vocab_size: the model's vocabulary size.
    Raises:
        FieldError: naming the first of the fields that ban every token.
    """
    params = request.sampling
    lists = (request.stop_token_ids, params.suppress_tokens, params.begin_suppress_tokens, params.bad_words_ids)
    most = sum(len(ids) for ids in lists) + (request.num_prompt_tokens if params.no_repeat_ngram_size else 0)
    if most < vocab_size:
        return  # too few ids to ban them all: no set is built
    banned, fields = first_token_bans(request)
    if len({token for token in banned if 0 <= token < vocab_size}) < vocab_size:
        return
    why = " (the stop tokens count while min_new_tokens masks them)" if "min_new_tokens" in fields else ""
    reason = (
        f"{', '.join(fields)} together ban all {vocab_size} tokens of the vocabulary at the first position{why}: no "
        "token could be drawn"
    )
    raise FieldError(fields[0], reason)

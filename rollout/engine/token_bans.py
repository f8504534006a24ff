"""Step 2 of the sampling pipeline: tokens a request may not generate next, set to -inf (transformers' semantics of
`no_repeat_ngram_size`, `bad_words_ids`, `suppress_tokens` and `begin_suppress_tokens`).

Bans that depend on the request's latest tokens (n-grams, multi-token bad words) read them from a per-request
history on the device, appended on the device after each draw: with overlapped scheduling the newest token is not on
the host yet when the next step is sampled, and nothing here waits for it.
"""

from __future__ import annotations

import torch

from rollout.config import SamplingParams
from rollout.engine.request import Request
from rollout.engine.transfer import to_device


def has_bans(params: SamplingParams) -> bool:
    """True when the request bans any token (cheap: the sampler asks it for every row of every step)."""
    return bool(
        params.no_repeat_ngram_size or params.bad_words_ids or params.suppress_tokens or params.begin_suppress_tokens
    )


def needs_history(params: SamplingParams) -> bool:
    """True when the request's bans depend on its latest tokens."""
    return params.no_repeat_ngram_size > 0 or any(len(word) > 1 for word in params.bad_words_ids)


def new_history(request: Request, device: torch.device) -> torch.Tensor:
    """The request's tokens so far in a device buffer with room for all it may generate (built at its first draw,
    when all its tokens are on the host)."""
    if request.has_placeholder:
        raise RuntimeError(f"token history of {request.request_id} built before its last token was resolved")
    history = torch.zeros(request.num_prompt_tokens + request.max_new_tokens, dtype=torch.long, device=device)
    history[: request.num_tokens] = to_device(request.token_ids, torch.long, device)
    return history


def static_bans(request: Request) -> list[int]:
    """Tokens banned whatever came before: suppress_tokens, single-token bad words (except stop tokens, as in
    transformers), and begin_suppress_tokens for the first generated token."""
    params = request.sampling
    banned = list(params.suppress_tokens)
    banned += [word[0] for word in params.bad_words_ids if len(word) == 1 and word[0] not in request.stop_token_ids]
    if request.num_output_tokens == 0:
        banned += params.begin_suppress_tokens
    return banned


def history_bans(scores: torch.Tensor, history: torch.Tensor, length: int, params: SamplingParams) -> None:
    """Ban, in one row of scores, the tokens that would complete a repeated n-gram or a multi-token bad word.

    Args:
        scores: (vocab,) the row, changed in place.
        history: the request's token buffer on the device; its first `length` entries are its tokens so far.
        length: how many tokens the request has (a host count, exact even while the newest value is on the device).
        params: the request's sampling parameters.
    """
    device = scores.device
    penalty = torch.zeros_like(scores)
    n = params.no_repeat_ngram_size
    if n and length >= n:
        windows = history[:length].unfold(0, n, 1)  # every n-gram so far
        repeats = (windows[:, :-1] == history[length - n + 1 : length]).all(dim=1)  # those starting like the next
        blocked = torch.where(repeats, float("-inf"), 0.0).to(scores.dtype)
        penalty.scatter_reduce_(0, windows[:, -1], blocked, reduce="amin")
    words = [word for word in params.bad_words_ids if 1 < len(word) <= length + 1]
    if words:
        matches = torch.stack(
            [
                (history[length - len(word) + 1 : length] == to_device(word[:-1], torch.long, device)).all()
                for word in words
            ]
        )
        blocked = torch.where(matches, float("-inf"), 0.0).to(scores.dtype)
        penalty.scatter_reduce_(0, to_device([word[-1] for word in words], torch.long, device), blocked, reduce="amin")
    scores.add_(penalty)


def record(history: torch.Tensor, length: int, token: torch.Tensor) -> None:
    """Append a drawn token (a one-element device tensor) at position `length`, on the device."""
    history[length : length + 1].copy_(token)

"""The "sampler_state" previous path (`ContinuousBatchingConfig.previous_paths`): each request's penalty and ban
state kept on the request (`Request.sampler_state`), stacked and applied row by row at every step, and updated
row by row after each draw. The default keeps that state in per-slot tables instead (`rollout.engine.slot_state`);
this path stays so that one GPU run can compare the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.request import Request
from rollout.engine.slot_columns import SlotColumns
from rollout.engine.token_bans import Bans, apply_bans, build_bans, has_bans, record
from rollout.engine.transfer import to_device


@dataclass
class SamplerState:
    """A request's sampling state on the device, kept on `Request.sampler_state` while it runs."""

    seen: torch.Tensor | None = None  # (vocab,) bool: in prompt or output (repetition_penalty)
    counts: torch.Tensor | None = None  # (vocab,) fp32: times generated (presence/frequency penalties)
    bans: Bans | None = None  # step 2 (token_bans)


def request_state(request: Request, vocab_size: int, device: torch.device) -> SamplerState | None:
    """The request's device state, built at its first draw (when all its tokens are on the host); None when its
    processors need none.

    Args:
        request: the sampled request.
        vocab_size: the logits' width.
        device: where the state lives.
    """
    if request.sampler_state is not None:
        return request.sampler_state
    params = request.sampling
    penalized = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
    if penalized or has_bans(params):
        if request.has_placeholder:
            raise RuntimeError(f"sampler state of {request.request_id} built before its last token was resolved")
        state = SamplerState()
        if penalized:
            state.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.seen.index_fill_(0, to_device(request.token_ids, torch.long, device), True)
            output = to_device(request.output_ids, torch.long, device)
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            # index_add_, not bincount: bincount on CUDA reads the largest id back to the host.
            state.counts = counts.index_add_(0, output, torch.ones_like(output, dtype=counts.dtype))
        if has_bans(params):
            state.bans = build_bans(request, device)
        request.sampler_state = state
    return request.sampler_state


def apply_penalties(scores: torch.Tensor, columns: SlotColumns, states: list[SamplerState | None]) -> None:
    """Step 1 on the penalized rows (their states stacked), in place.

    Args:
        scores: (rows, vocab) fp32 scores.
        columns: the rows' sampling parameters.
        states: each row's state (None: no penalty nor ban).
    """
    rows = [i for i, state in enumerate(states) if state is not None and state.seen is not None]
    if not rows:
        return
    seen = torch.stack([states[i].seen for i in rows])
    counts = torch.stack([states[i].counts for i in rows])
    index = to_device(rows, torch.long, scores.device)
    sub = scores.index_select(0, index)
    repetition = columns.float("repetition_penalty").index_select(0, index)
    presence = columns.float("presence_penalty").index_select(0, index)
    frequency = columns.float("frequency_penalty").index_select(0, index)
    sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
    sub = sub - presence * (counts > 0) - frequency * counts
    scores.index_copy_(0, index, sub)


def apply_request_bans(scores: torch.Tensor, requests: list[Request], states: list[SamplerState | None]) -> None:
    """Step 2, on the rows of requests that ban tokens (one attribute check per row otherwise)."""
    for i, request in enumerate(requests):
        state = states[i]
        if state is not None and state.bans is not None:
            apply_bans(scores[i], state.bans, request.num_tokens, request.num_output_tokens)


def mask_early_stops(scores: torch.Tensor, requests: list[Request]) -> None:
    """Step 3, min_new_tokens: stop tokens get -inf while fewer than min_new_tokens tokens were generated."""
    rows: list[int] = []
    columns: list[int] = []
    for i, request in enumerate(requests):
        if request.num_output_tokens < request.sampling.min_new_tokens and request.stop_token_ids:
            rows += [i] * len(request.stop_token_ids)
            columns += request.stop_token_ids
    if rows:
        index = to_device([rows, columns], torch.long, scores.device)
        scores.index_put_((index[0], index[1]), scores.new_full((), float("-inf")))


def record_draws(requests: list[Request], states: list[SamplerState | None], token_ids: torch.Tensor) -> None:
    """Count / append each drawn token in its request's device state. index_fill_/index_add_ with a one-element
    index tensor: indexing with a 0-dim device tensor (`seen[token] = True`) would read the index back to the host."""
    for index, (request, state) in enumerate(zip(requests, states)):
        if state is None:
            continue
        token = token_ids[index : index + 1]
        if state.seen is not None:
            state.seen.index_fill_(0, token, True)
            state.counts.index_add_(0, token, torch.ones(1, dtype=state.counts.dtype, device=state.counts.device))
        if state.bans is not None:
            record(state.bans, request.num_tokens, token)

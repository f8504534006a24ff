"""A stream that survives a failover: a group resubmitted to another worker streams again from its first token (the
same seed, the same tokens), so each delta is passed on only past what the caller already has (`Call.delivered`),
with its per-token arrays cut alike and the prompt's fields only on the first delta its caller gets of a sample (not
again when a resubmitted group's worker sends them with its own first delta)."""

from __future__ import annotations

from typing import Any

from rollout import protocol as p
from trainer_bridge.client.calls import Call


def splice(call: Call, message: p.Delta) -> p.Delta | None:
    """The part of a received delta its caller does not have yet, under the caller's group id (None: nothing new).

    Args:
        call: the group's call (its `received` and `delivered` token counts per sample are advanced).
        message: the delta as received from the call's current worker (its arrays unpacked).
    """
    sample = message.sample_index
    first = call.received.get(sample, 0)  # position of this delta's first token
    call.received[sample] = first + len(message.token_ids)
    skip = max(0, call.delivered.get(sample, 0) - first)
    if skip >= len(message.token_ids):
        return None
    call.delivered[sample] = call.received[sample]

    def tail(values: Any) -> Any:
        return None if values is None else values[skip:]

    delta = p.Delta(
        call.group.group_id,
        sample,
        message.token_ids[skip:],
        message.logprobs[skip:],
        message.policy_version,
        routes=tail(message.routes),
        top_token_ids=tail(message.top_token_ids),
        top_logprobs=tail(message.top_logprobs),
    )
    if first == skip == 0:  # the sample's first delta, its caller's first (a failover's resend has them again)
        delta.prompt_routes, delta.prompt_logprobs = message.prompt_routes, message.prompt_logprobs
        delta.prompt_logprob_ranks = message.prompt_logprob_ranks
        delta.prompt_top_token_ids, delta.prompt_top_logprobs = (
            message.prompt_top_token_ids,
            message.prompt_top_logprobs,
        )
    return delta

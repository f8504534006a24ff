"""Whether a worker's delta or group result fits the group it answers: a reply that does not (a result with fewer or
more samples than the group's n, samples out of order, tokens without their log-probs, a finish reason the protocol
does not have, another prompt) fails its call naming why, instead of reaching the trainer as a silently wrong
group (a worker of another version, or a bug: a GRPO group of no samples becomes NaN advantages)."""

from __future__ import annotations

from rollout import protocol as p
from trainer_bridge.client.calls import PromptGroup

FINISH_REASONS = ("stop", "length", "abort", "error")  # a Completion's (rollout/protocol/messages.py)


def reply_problem(group: PromptGroup, message: p.Message) -> tuple[str, str] | None:
    """(field, reason) where `message` (a delta or group result of `group`) does not fit it; None when it does.

    Args:
        group: the group the call sent (its n and prompt).
        message: the worker's reply to it.
    """
    if isinstance(message, p.Delta):
        if not 0 <= message.sample_index < group.n:
            return "sample_index", f"{message.sample_index} is not a sample of a group of {group.n}"
        return _lengths(message, "")
    if not isinstance(message, p.GroupResult):
        return None
    if len(message.completions) != group.n:
        return "completions", f"{len(message.completions)} completions for a group of {group.n}"
    if message.prompt_ids != group.prompt_ids:
        return "prompt_ids", f"another prompt ({len(message.prompt_ids)} tokens) than the group's"
    for index, completion in enumerate(message.completions):
        prefix = f"completions[{index}]."
        if completion.sample_index != index:
            return f"{prefix}sample_index", f"{completion.sample_index}, expected {index}"
        if completion.finish_reason not in FINISH_REASONS:
            return f"{prefix}finish_reason", f"{completion.finish_reason!r} is none of {FINISH_REASONS}"
        problem = _lengths(completion, prefix)
        if problem is not None:
            return problem
    return None


def _lengths(sample: p.Delta | p.Completion, prefix: str) -> tuple[str, str] | None:
    """A sample's tokens each with its log-prob (or none at all: a worker that returns no log-probs)."""
    if sample.logprobs and len(sample.logprobs) != len(sample.token_ids):
        return f"{prefix}logprobs", f"{len(sample.logprobs)} log-probs for {len(sample.token_ids)} tokens"
    return None

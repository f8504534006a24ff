"""A step's inputs as the model runner packs them: the input ids of every scheduled sequence one after the other (a
token still on the device read there: overlapped scheduling), their requests and start positions, and the packed
rows whose logits the step keeps (a sequence's last token; a drafted decode's last token and each draft token)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import PLACEHOLDER_TOKEN, Request
from rollout.engine.scheduling.batch import ScheduledBatch


@dataclass
class UnresolvedTokens:
    """The previous step's sampled tokens while they are only on the device (overlapped scheduling)."""

    token_ids: torch.Tensor  # (samples,) int64, in the previous batch's `samples` order
    rows: dict[Request, int]  # request -> its row in token_ids


@dataclass
class StepInputs:
    """A step's packed input ids and its sequences' requests and start positions."""

    token_ids: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    one_token_each: bool = True  # every sequence computes a single token
    # (packed indices, token ids on the device) of inputs sampled by the previous step and not on the host yet.
    device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None


def step_inputs(batch: ScheduledBatch, unresolved: UnresolvedTokens | None, device: torch.device) -> StepInputs:
    """The step's packed input ids (0 where a token is still on the device, with the (packed indices, device token
    ids) to put there), its requests and their start positions, in one pass. Only a request's last token can be
    unresolved, so only a chunk's last one is.

    Args:
        batch: the step.
        unresolved: the previous step's sampled tokens still on the device (None: every token is on the host).
        device: where the model runs.
    Raises:
        RuntimeError: an input token is a placeholder that `unresolved` does not cover.
    """
    inputs = StepInputs()
    input_ids, requests, starts = inputs.token_ids, inputs.requests, inputs.starts
    targets: list[int] = []
    sources: list[int] = []
    for seq in batch.sequences:  # runs for every sequence at every step
        request, start = seq.request, seq.start
        requests.append(request)
        starts.append(start)
        if seq.num_tokens == 1:
            token = request.token_ids[start]
            input_ids.append(token)
        elif seq.draft:  # its last token (on the host: a drafted request has no placeholder), then the drafts
            inputs.one_token_each = False
            input_ids.append(request.token_ids[start])
            input_ids.extend(seq.draft)
            continue
        else:
            inputs.one_token_each = False
            input_ids.extend(request.token_ids[start : start + seq.num_tokens])
            token = input_ids[-1]
        if token == PLACEHOLDER_TOKEN:
            row = None if unresolved is None else unresolved.rows.get(request)
            if row is None:
                raise RuntimeError(
                    f"the input token of {request.request_id} is neither on the host nor among the previous "
                    "step's samples"
                )
            input_ids[-1] = 0
            targets.append(len(input_ids) - 1)
            sources.append(row)
    if targets:
        index = to_device([targets, sources], torch.long, device)
        inputs.device_tokens = (index[0], unresolved.token_ids.index_select(0, index[1]))
    return inputs


def logits_rows(batch: ScheduledBatch, lengths: list[int]) -> list[int]:
    """The packed rows whose logits the step keeps, in `batch.samples`' row order: each logits sequence's last
    token, and for a drafted decode its last token and each draft token (1 + len(draft) rows).

    Args:
        batch: the step.
        lengths: each sequence's tokens computed (`num_tokens`), in order.
    """
    ends = list(itertools.accumulate(lengths))
    if not batch.num_draft_tokens:
        return [ends[index] - 1 for index in batch.logits_sequences]
    sequences = batch.sequences
    return [
        row
        for index in batch.logits_sequences
        for row in range(ends[index] - 1 - len(sequences[index].draft), ends[index])
    ]

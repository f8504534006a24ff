"""A drafted step laid out for the verify CUDA graphs (`DecodeGraphs` with `width` > 1): every sequence takes `width`
rows, padding tokens first, then its last token and its draft tokens; the logits rows the step keeps are gathered
from there in the sampler's order.

Padding goes first so that the attention kernel, which numbers a sequence's rows from its first position and reads
keys up to the last row of each query tile, reads nothing past the sequence's real end (a slot there may hold a
previous owner's NaN, and a masked key's weight 0 times NaN is NaN). The padding tokens sit at the positions just
before the real ones, whose keys are cached and finite; their own keys and values go to the scratch slot (`valid`
False), so the cached ones stay as they were."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.engine.runner.step_inputs import StepInputs
from rollout.engine.scheduling.batch import ScheduledBatch


@dataclass
class VerifyLayout:
    """The rows of one drafted step in the verify graphs' layout."""

    token_ids: list[int]
    positions: list[int]
    valid: list[bool]
    kept: list[int]  # the graph's rows whose logits the step keeps, in logits-row order


def verify_layout(batch: ScheduledBatch, inputs: StepInputs, width: int) -> VerifyLayout | None:
    """The step laid out `width` rows per sequence, or None when the verify graphs cannot serve it: a sequence that
    computes anything but its last token and its drafts (a prefill chunk), more drafts than `width - 1`, fewer
    cached positions than its padding tokens, a sequence without logits, or an input token still on the device.

    Args:
        batch: a step with draft tokens.
        inputs: its packed inputs (`step_inputs`).
        width: rows per sequence of the graphs.
    """
    if inputs.device_tokens is not None or len(batch.logits_sequences) != len(batch.sequences):
        return None
    layout = VerifyLayout([], [], [], [])
    packed = 0
    for seq in batch.sequences:
        real = seq.num_tokens
        padding = width - real
        if real != 1 + len(seq.draft) or padding < 0 or seq.start < padding:  # too few cached positions to pad on
            return None
        layout.token_ids += [0] * padding + inputs.token_ids[packed : packed + real]
        layout.positions += list(range(seq.start - padding, seq.start + real))
        layout.valid += [False] * padding + [True] * real
        packed += real
    for index in batch.logits_sequences:
        first = (index + 1) * width - batch.sequences[index].num_tokens
        layout.kept += range(first, (index + 1) * width)
    return layout

"""A drafted step laid out for the verify CUDA graphs (`DecodeGraphs` with `width` > 1): every sequence takes `width`
rows, its last token's, its draft tokens', then padding tokens (the draft's last position repeated, their keys and
values sent to the scratch slot); the logits rows the step keeps are gathered from there in the sampler's order."""

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
    computes anything but its last token and its drafts (a prefill chunk), more drafts than `width - 1`, a sequence
    without logits, or an input token still on the device.

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
        if real != 1 + len(seq.draft) or real > width:
            return None
        layout.token_ids += inputs.token_ids[packed : packed + real] + [0] * (width - real)
        last = seq.start + real - 1
        layout.positions += list(range(seq.start, last + 1)) + [last] * (width - real)
        layout.valid += [True] * real + [False] * (width - real)
        packed += real
    for index in batch.logits_sequences:
        seq = batch.sequences[index]
        layout.kept += range(index * width, index * width + 1 + len(seq.draft))
    return layout

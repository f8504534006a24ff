"""One step's sampling parameters, a row per sampled row, gathered from the slot tables of `sampling_slots.py`: the
columns of its two tables, and each row's uniform number for its draw. Plain views; the tables live in SamplingSlots."""

from __future__ import annotations

import torch

# Columns of the float table (fp32), in this order.
FLOAT_COLUMNS = (
    "temperature",  # 1 for greedy rows (they are never divided)
    "top_p_cut",  # 1 - top_p, computed in double as transformers' TopPLogitsWarper compares with it (0: off)
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprob_divisor",  # temperature_scaled rows: their temperature (1 when it is 0); other rows 1
)
# Columns of the integer table (int64), in this order.
INT_COLUMNS = (
    "top_k",  # the vocabulary size when top_k is off
    "greedy",  # 1: argmax; 0: drawn
    "use_processed",  # 1: log-probs of the processed scores; 0: of the raw or temperature-scaled logits
    "prompt_tokens",  # the prompt's length: a row's output count is its position minus this
    "min_new_tokens",  # 0 when the request has no stop token to mask
    "ngram",  # no_repeat_ngram_size (0: off)
)
_F = {name: i for i, name in enumerate(FLOAT_COLUMNS)}
_I = {name: i for i, name in enumerate(INT_COLUMNS)}


class SlotColumns:
    """One step's parameters, one row per sampled row (views into two gathered tensors)."""

    def __init__(
        self,
        floats: torch.Tensor,
        ints: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        max_position: int,
        uniform: torch.Tensor,
    ):
        self._floats = floats
        self._ints = ints
        self.slots = slots  # (rows,) int64: each row's slot
        self.positions = positions  # (rows,) int64: position of the token each row samples
        self.max_position = max_position  # the largest of them (a host count)
        # (rows,) float64 in (0, 1): each row's number for its draw, a pure function of (seed, sample_index,
        # position) (`draw.uniforms`)
        self.uniform = uniform

    def float(self, name: str) -> torch.Tensor:
        """(rows, 1) fp32 column `name` of FLOAT_COLUMNS (one slicing op: this runs several times a step)."""
        index = _F[name]
        return self._floats[:, index : index + 1]

    def int(self, name: str) -> torch.Tensor:
        """(rows,) int64 column `name` of INT_COLUMNS."""
        return self._ints[:, _I[name]]

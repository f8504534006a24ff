"""The logit bias, first in the sampling pipeline (`Sampler`), for all of a step's rows at once:
`SamplingParams.logit_bias` (OpenAI / vLLM semantics), added to the model's logits before any other processing.

Each running sample's biases live in two per-slot device tables written at its first draw, like the ban lists of
`rollout.engine.sampling.slot_state`:

  tokens  (slots, width) int64  the biased token ids, padded with the vocabulary size (a column past the logits)
  values  (slots, width) fp32   their biases, padded with 0

A step gathers its rows, scatters them into one (rows, vocab + 1) table and adds it to the scores: a fixed number of
kernels whatever the number of rows or biased tokens, and no host read. The tables exist only while some live
sample sets a bias (the sampler skips the step otherwise); while they exist a new sample's rows are written whether
it sets one or not (padding), so a slot's previous owner leaves nothing behind.
"""

from __future__ import annotations

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request
from rollout.engine.sampling.slot_columns import SlotColumns


class SlotBias:
    """Per-slot device tables of the running samples' logit biases (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int):
        """
        Args:
            vocab_size: the logits' width (also the tokens' padding: a column past the logits).
            device: where the tables live.
            capacity: slots the tables hold (as many as `SamplingSlots`'; `grow` follows it).
        """
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = capacity
        self.tokens: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._users: set[int] = set()  # live slots whose sample sets a bias

    @property
    def active(self) -> bool:
        """Whether some live sample sets a bias (a step skips step 0 otherwise)."""
        return bool(self._users)

    def assign(self, requests: list[Request]) -> None:
        """Write the rows of samples at their first draw (their slots just taken), in one copy per table."""
        rows = [request.sampling.logit_bias for request in requests]
        self._users.update(r.sampling_slot for r, row in zip(requests, rows) if row)
        if not self._users:
            return
        width = max([len(row) for row in rows] + [1])
        if self.tokens is None:
            self.tokens = torch.full((self.capacity, width), self.vocab_size, dtype=torch.long, device=self.device)
            self.values = torch.zeros(self.capacity, width, dtype=torch.float32, device=self.device)
        elif width > self.tokens.shape[1]:
            extra = width - self.tokens.shape[1]
            self.tokens = torch.cat([self.tokens, self.tokens.new_full((self.capacity, extra), self.vocab_size)], 1)
            self.values = torch.cat([self.values, self.values.new_zeros(self.capacity, extra)], 1)
        width = self.tokens.shape[1]
        pad = [width - len(row) for row in rows]
        tokens = [[token for token, _ in row] + [self.vocab_size] * p for row, p in zip(rows, pad)]
        values = [[bias for _, bias in row] + [0.0] * p for row, p in zip(rows, pad)]
        index = to_device([request.sampling_slot for request in requests], torch.long, self.device)
        self.tokens.index_copy_(0, index, to_device(tokens, torch.long, self.device))
        self.values.index_copy_(0, index, to_device(values, torch.float32, self.device))

    def release(self, slot: int) -> None:
        """Forget a finished sample's slot; the tables are freed once no live sample sets a bias."""
        self._users.discard(slot)
        if not self._users:
            self.tokens = self.values = None

    def grow(self, capacity: int) -> None:
        """Give the tables `capacity` rows (stream-ordered copies: steps already queued read the old ones)."""
        extra = capacity - self.capacity
        self.capacity = capacity
        if self.tokens is not None:
            self.tokens = torch.cat([self.tokens, self.tokens.new_full((extra, self.tokens.shape[1]), self.vocab_size)])
            self.values = torch.cat([self.values, self.values.new_zeros(extra, self.values.shape[1])])

    def apply(self, scores: torch.Tensor, columns: SlotColumns) -> torch.Tensor:
        """Step 0 for every row at once: `scores` plus each row's biases, as a new tensor (`scores` is left as it
        was: the sampler keeps the model's logits for the "raw" and "temperature_scaled" log-probs). A row without
        a bias adds zeros and comes out exactly as it went in.

        Args:
            scores: (rows, vocab) fp32 logits.
            columns: the rows' slots.
        """
        if self.tokens is None:
            return scores
        tokens = self.tokens.index_select(0, columns.slots)
        values = self.values.index_select(0, columns.slots)
        # A row's tokens are distinct; the padding column takes only zeros, in whatever order they land.
        bias = scores.new_zeros(scores.shape[0], self.vocab_size + 1)
        bias.scatter_(1, tokens, values)
        return scores + bias[:, : self.vocab_size]

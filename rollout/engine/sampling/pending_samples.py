"""A step's sampled tokens on their way to the host: queued with the sampling, fetched (one copy) when the engine
resolves the step, as Python values; and the step they belong to while it is in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.engine.kv.transfer import HostCopy
from rollout.engine.moe.routes import PendingRoutes
from rollout.engine.sampling.prompt_logprobs import PendingPromptLogprobs
from rollout.engine.scheduling.batch import ScheduledBatch


@dataclass
class SamplerOutput:
    """One entry per sampled row, in `batch.samples` order (plain Python values)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Rows whose bans left no token to draw (their token is meaningless; the engine ends those samples).
    dead_rows: list[int] = field(default_factory=list)
    # Rows whose model logits were not finite (their token is meaningless; the engine ends those samples and keeps
    # their KV out of the prefix cache).
    broken_rows: list[int] = field(default_factory=list)

    def select(self, rows: list[int]) -> SamplerOutput:
        """These rows' entries, in this order (their fault rows renumbered to it).

        Args:
            rows: row indices, each at most once.
        """
        where = {row: index for index, row in enumerate(rows)}

        def picked(values: list | None) -> list | None:
            return None if values is None else [values[row] for row in rows]

        return SamplerOutput(
            picked(self.token_ids),
            picked(self.logprobs),
            picked(self.top_logprobs),
            sorted(where[row] for row in self.dead_rows if row in where),
            sorted(where[row] for row in self.broken_rows if row in where),
        )


# Each row's fault code, brought to the host with its token: what `SamplerOutput` sorts rows by.
NO_FAULT, NOTHING_DRAWABLE, NOT_FINITE = 0.0, 1.0, 2.0


def pack(parts: list[torch.Tensor], faults: torch.Tensor | None) -> torch.Tensor:
    """The parts and fault codes of a step's rows as one float64 vector, brought to the host in one copy (float64
    holds token ids exactly).

    Args:
        parts: 1-D tensors: token ids, then (with log-probs) the chosen log-probs, then (with top log-probs) the
            flattened top values and top indices.
        faults: (rows,) `row_faults` codes, last (None: not checked).
    """
    parts = parts if faults is None else [*parts, faults]
    return torch.cat([part.double() for part in parts])


def row_faults(broken: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
    """(rows,) fault codes: NOT_FINITE where the model's logits were not finite (it outranks the rest), else
    NOTHING_DRAWABLE where nothing was left to draw (`dead`, None: not checked), else NO_FAULT.

    Args:
        broken: (rows,) bool, logits not finite.
        dead: (rows,) bool, no drawable token, or None.
    """
    codes = broken.double() * NOT_FINITE
    return codes if dead is None else torch.where(broken, codes, dead.double() * NOTHING_DRAWABLE)


class PendingSamples:
    """A step's sampled tokens: on the device at once (`token_ids`, for the next step's inputs), on the host after
    `fetch()`. Everything the host needs comes down in one copy, queued when the sampling was."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        parts: list[torch.Tensor],
        top_counts: list[int] | None,
        faults: torch.Tensor | None = None,
    ):
        """
        Args:
            token_ids: (rows,) int64 sampled tokens on the device.
            parts: 1-D device tensors brought to the host together: token ids, then (with logprobs) the chosen
                log-probs, then (with top log-probs) the flattened top values and top indices.
            top_counts: per row, how many top log-probs it asked for (None: top log-probs not computed).
            faults: (rows,) `row_faults` codes (None: not checked); copied with the rest, last.
        """
        self.token_ids = token_ids
        self._rows = token_ids.shape[0]
        self._has_logprobs = len(parts) > 1
        self._top_counts = top_counts
        self._checked = faults is not None
        self._host = HostCopy(pack(parts, faults)) if self._rows else None
        self._fetched: SamplerOutput | None = None
        self._head_of: PendingSamples | None = None  # `first_rows`: these are the first rows of another's

    @classmethod
    def packed(
        cls, token_ids: torch.Tensor, packed: torch.Tensor, has_logprobs: bool, top_counts: list[int] | None
    ) -> PendingSamples:
        """Samples whose parts and fault codes were packed on the device already (`pack`, in a sampler graph).

        Args:
            token_ids: (rows,) int64 sampled tokens on the device.
            packed: `pack(parts, faults)` of those rows, faults included.
            has_logprobs: the parts hold log-probs.
            top_counts: per row, how many top log-probs it asked for (None: not computed).
        """
        pending = cls(token_ids[:0], [], None)  # nothing to copy yet
        pending.token_ids, pending._rows = token_ids, token_ids.shape[0]
        pending._has_logprobs, pending._top_counts, pending._checked = has_logprobs, top_counts, True
        pending._host = HostCopy(packed)
        return pending

    def first_rows(self, count: int) -> PendingSamples:
        """The first `count` rows as samples of their own, brought to the host by this one's copy (a drafted step's
        first draws, sampled in one pass with its draws ahead: `verify.sample_drafted`).

        Args:
            count: rows, from the first.
        """
        if count == self._rows:
            return self
        head = PendingSamples(self.token_ids[:0], [], None)  # no copy of its own
        head.token_ids, head._rows, head._head_of = self.token_ids[:count], count, self
        return head

    @classmethod
    def on_host(cls, output: SamplerOutput) -> PendingSamples:
        """Samples already fetched (a verification round's share of draws that came with its step): `fetch()`
        returns `output`, and there is nothing on the device."""
        pending = cls(torch.empty(0, dtype=torch.long), [], None)
        pending._fetched = output
        return pending

    def select(self, rows: list[int]) -> SamplerOutput:
        """The fetched values of these rows, in this order (their fault rows renumbered to it).

        Args:
            rows: indices of this step's rows; each at most once.
        """
        return self.fetch().select(rows)

    def fetch(self) -> SamplerOutput:
        """The sampled tokens and log-probs as Python values (waits for the copy to land; later calls return the
        same values: a constrained next step fetches them early, the step's resolve again)."""
        if self._fetched is None:
            head_of = self._head_of
            self._fetched = self._fetch() if head_of is None else head_of.select(list(range(self._rows)))
        return self._fetched

    def _fetch(self) -> SamplerOutput:
        if self._host is None:
            return SamplerOutput([], [] if self._has_logprobs else None, None)
        host = self._host.tensor()
        rows = self._rows
        tokens = host[:rows].long().tolist()
        dead_rows: list[int] = []
        broken_rows: list[int] = []
        if self._checked:
            codes = host[-rows:]
            dead_rows = (codes == NOTHING_DRAWABLE).nonzero().flatten().tolist()
            broken_rows = (codes == NOT_FINITE).nonzero().flatten().tolist()
        if not self._has_logprobs:
            return SamplerOutput(tokens, None, None, dead_rows, broken_rows)
        chosen = host[rows : 2 * rows].tolist()
        top = None
        if self._top_counts is not None:
            width = max(self._top_counts)
            values = host[2 * rows : 2 * rows + rows * width].tolist()
            indices = host[2 * rows + rows * width : 2 * rows + 2 * rows * width].long().tolist()
            # One C-level zip for every row, then a slice per row (this runs for every row of every step).
            pairs = list(zip(indices, values))
            top = [
                pairs[start : start + count] for start, count in zip(range(0, rows * width, width), self._top_counts)
            ]
        return SamplerOutput(tokens, chosen, top, dead_rows, broken_rows)


@dataclass
class InFlightStep:
    """A step queued on the device whose sampled tokens the host has not seen yet (overlapped scheduling)."""

    batch: ScheduledBatch
    samples: PendingSamples
    policy_version: int  # the weights that ran it (a weight update drains the step first)
    advanced: bool = False  # the scheduler counted its tokens (placeholders appended)
    prompt_logprobs: PendingPromptLogprobs | None = None  # what it scored of prompts (prompt_logprobs.py)
    routes: PendingRoutes | None = None  # the MoE routes it recorded (routes.py)
    constrained: bool = False  # some sample follows a grammar (its next mask needs this step's token on the host)
    logits: torch.Tensor | None = None  # a drafted step's logits, every row, kept for its verification
    # A drafted step's draws at its draft positions, queued with it for the samples that keep no token-dependent
    # state (`verify.sample_drafted`), and (id(request), draft position) -> their row there.
    ahead: PendingSamples | None = None
    ahead_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    verifying: bool = False  # a round of a drafted step's verification (every sample of it drafted)

"""CUDA graphs of the sampler's pass (`SamplerGraphs`). On a GPU a step's sampling is some fifty small operators, each
launched from Python (about 1 ms of host time a step at 256 rows on an H200, as much as the rest of the engine's
host work); a captured pass replays them in one launch.

A pass is captured per (rows bucket, widest top log-probs, log-probs or not, logits dtype) and per set of decisions
its capture asked of the live slots (`SamplingSlots.recording`: which processors some or every live sample uses,
the largest top_k, ...): a graph serves a step only while each of those decisions answers the same and the
parameter tables are where they were. The sampler sends only passes that read no other table (no logit_bias,
penalty, ban, min_new_tokens or grammar among the live samples), each sample's logits row picked first where rows
are shared or drawn ahead (a group's first token, speculative decoding's drafted steps).

Invariants:
- Before each replay the step's logits and its rows' index (slots, positions, uniform numbers: `host_index`) are
  copied into persistent buffers. Rows past the step's, up to the bucket, are padding: they read what the buffers
  hold (former rows, or zeros), draw meaningless tokens that no one reads, and write nothing (a graphed pass records
  no token-dependent state).
- The graph's outputs are overwritten by its next replay: the tokens are copied out, and the packed vector's copy to
  the host is queued at once (`PendingSamples.packed`), so nothing reads them later.
- The tokens drawn are the eager pass's: the same operators on the same values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.sampling.pending_samples import PendingSamples
from rollout.engine.sampling.slots import SamplingSlots

logger = logging.getLogger(__name__)

# (logits (bucket, vocab), index (3, bucket), widest top log-probs, log-probs or not) -> (tokens (bucket,), packed)
SamplePass = Callable[[torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
MAX_GRAPHS = 64  # captured passes kept; past it every one is dropped and captured again as used
CAPTURE_AT_SIGHTING = 2  # a (key, decisions) is captured the second time a step needs it
MAX_SIGHTINGS = 4096  # (key, decisions) counted at most; past it the counts start again


@dataclass
class _Captured:
    """One captured pass and what it depends on."""

    graph: torch.cuda.CUDAGraph | None  # None: capture off, the pass runs again on the buffers, as captured
    decisions: list  # (query, answer) its capture asked of the live slots
    tables: tuple[torch.Tensor, torch.Tensor]  # the parameter tables it read
    token_ids: torch.Tensor | None  # its outputs (overwritten by each replay; None with capture off)
    packed: torch.Tensor | None


class SamplerGraphs:
    """Captured sampling passes over persistent input buffers (see the module docstring)."""

    def __init__(self, slots: SamplingSlots, buckets: list[int], capture: bool = True):
        """
        Args:
            slots: the live slots (their decisions and tables).
            buckets: the row counts that get a graph, increasing.
            capture: False runs the pass again on the buffers at each step instead of replaying it (CPU tests of the
                padding, buffers and decisions; CUDA graphs need a CUDA device).
        """
        self._slots = slots
        self.buckets = buckets
        self.capture_enabled = capture
        self.disabled_reason: str | None = None  # set when a capture failed: sampling then runs eagerly
        self._index = torch.zeros((3, buckets[-1]), dtype=torch.long, device=slots.device)
        self._logits: dict[torch.dtype, torch.Tensor] = {}
        self._captured: dict[tuple[int, int, bool, torch.dtype], list[_Captured]] = {}
        self._sightings: dict[tuple, int] = {}  # (key, decisions) -> steps that needed it uncaptured
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # passes captured (or, capture off, recorded) so far
        self.replays = 0  # steps a captured pass served

    @property
    def num_captured(self) -> int:
        """Passes held now."""
        return sum(len(entries) for entries in self._captured.values())

    def release(self) -> None:
        """Drop every captured pass and its memory, and the logits buffers (captured again when next used)."""
        self._drop_captured()
        self._logits.clear()

    def _drop_captured(self) -> None:
        self._captured.clear()
        self._pool = torch.cuda.graph_pool_handle() if self.capture_enabled else None

    def sample(
        self,
        sample_pass: SamplePass,
        logits: torch.Tensor,
        host_index: np.ndarray,
        top_counts: list[int] | None,
        return_logprobs: bool,
    ) -> PendingSamples | None:
        """A step's samples through the graphs' buffers: from a captured pass, or, where none fits, from the pass run
        eagerly there (captured at its second sighting); None when the graphs cannot serve (more rows than the
        largest bucket, or a capture failed): the sampler then runs the pass eagerly itself.

        Args:
            sample_pass: the sampler's pass over the buffers (`Sampler._graph_pass`), run eagerly where no captured
                pass fits (and, capture off, as a replay). Passed at each call, never kept: the sampler holds these
                graphs.
            logits: (rows, vocab) logits, one row per sample.
            host_index: (3, rows) the rows' slots, positions and uniform numbers' bits (`SamplingSlots.host_index`).
            top_counts: per row, how many top log-probs it asks for (None: none).
            return_logprobs: compute log-probs.
        """
        rows = logits.shape[0]
        if self.disabled_reason is not None or rows > self.buckets[-1]:
            return None
        bucket = next(size for size in self.buckets if size >= rows)
        top_width = max(top_counts) if top_counts else 0
        key = (bucket, top_width, return_logprobs, logits.dtype)
        buffer = self._logits.get(logits.dtype)
        if buffer is None:
            shape = (self.buckets[-1], logits.shape[1])
            buffer = self._logits[logits.dtype] = torch.zeros(shape, dtype=logits.dtype, device=logits.device)
        buffer[:rows].copy_(logits)
        index = torch.from_numpy(host_index)
        self._index[:, :rows].copy_(index.pin_memory() if self._index.is_cuda else index, non_blocking=True)
        logits, index = buffer[:bucket], self._index[:, :bucket]
        captured = self._find(key)
        counts = None if top_counts is None else top_counts + [0] * (bucket - rows)
        if captured is None:  # eagerly on the buffers, its decisions recorded; captured at its second sighting
            with self._slots.recording() as decisions:
                token_ids, packed = sample_pass(logits, index, top_width, return_logprobs)
            if self._sighted(key, decisions):
                self._capture(sample_pass, key, decisions)
            return PendingSamples.packed(token_ids, packed, return_logprobs, counts).first_rows(rows)
        if captured.graph is not None:
            captured.graph.replay()
            token_ids, packed = captured.token_ids.clone(), captured.packed
        else:  # what a replay computes: the captured decisions and tables, whatever the live slots say now
            with self._slots.as_captured(captured.decisions, captured.tables):
                token_ids, packed = sample_pass(logits, index, top_width, return_logprobs)
        self.replays += 1
        return PendingSamples.packed(token_ids, packed, return_logprobs, counts).first_rows(rows)

    def _find(self, key: tuple[int, int, bool, torch.dtype]) -> _Captured | None:
        """The captured pass of `key` whose decisions all answer the same now; passes over tables that moved since
        are dropped (they can never serve again)."""
        floats, ints = self._slots.tables()
        entries = self._captured.get(key, [])
        entries[:] = [entry for entry in entries if entry.tables[0] is floats and entry.tables[1] is ints]
        return next((entry for entry in entries if self._slots.still(entry.decisions)), None)

    def _sighted(self, key: tuple[int, int, bool, torch.dtype], decisions: list) -> bool:
        """Count a sighting of (key, decisions) that no captured pass served; True from its second on: a pass worth
        capturing (a capture costs a device synchronisation and a few milliseconds: a combination seen once is not)."""
        if len(self._sightings) >= MAX_SIGHTINGS:
            self._sightings.clear()
        signature = (key, tuple(decisions))
        self._sightings[signature] = seen = self._sightings.get(signature, 0) + 1
        return seen >= CAPTURE_AT_SIGHTING and self.disabled_reason is None  # again after its pass was dropped

    def _capture(self, sample_pass: SamplePass, key: tuple[int, int, bool, torch.dtype], decisions: list) -> None:
        """Capture the pass of `key`, which just ran eagerly on the buffers with these decisions (Triton compiled,
        lazy allocations made outside the graph); a failed capture turns graphs off with a warning."""
        if self.num_captured >= MAX_GRAPHS:
            self._drop_captured()
        bucket, top_width, return_logprobs, dtype = key
        logits, index = self._logits[dtype][:bucket], self._index[:, :bucket]
        graph = token_ids = packed = None
        if self.capture_enabled:
            graph = torch.cuda.CUDAGraph()
            # Captured on a side stream ordered after the work queued so far, without `torch.cuda.graph`'s device
            # synchronisation and emptied allocator caches (device and pinned host memory): a pass is captured while
            # serving, and the steps after it would allocate their pinned copies afresh.
            with torch.cuda.device(index.device):  # the capture stream and the pool: this engine's device
                stream = torch.cuda.current_stream()
                side = torch.cuda.Stream()
                side.wait_stream(stream)
                try:
                    with torch.cuda.stream(side):
                        graph.capture_begin(self._pool, capture_error_mode="thread_local")
                        try:
                            token_ids, packed = sample_pass(logits, index, top_width, return_logprobs)
                        finally:
                            graph.capture_end()
                except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager sampling
                    self.disabled_reason = f"{type(error).__name__}: {error}"
                    self._drop_captured()
                    logger.warning("sampler graph capture failed (%s); sampling runs eagerly", self.disabled_reason)
                    return
                finally:
                    torch.cuda.set_stream(stream)
                stream.wait_stream(side)
        captured = _Captured(graph, decisions, self._slots.tables(), token_ids, packed)
        self._captured.setdefault(key, []).append(captured)
        self.captures += 1

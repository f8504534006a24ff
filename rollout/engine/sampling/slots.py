"""Each running sample's sampling parameters, kept on the device in persistent per-slot buffers.

A sample takes a slot at its first draw and keeps it until it finishes (through preemption and recompute): its
temperature, top-k/p, min-p, typical-p, epsilon/eta cutoffs, penalties, greediness and log-prob mode are written into
one row of two device tables once (its seed's stream id into a host array), and every step gathers its rows by slot
index (one host-to-device copy of the step's slot indices, positions and draws' uniform numbers, then two
`index_select`s) instead of rebuilding columns from Python objects. A host-side count of the live slots that use each
processor lets a step skip the processors nobody asks for; a row that does not ask holds its processor's neutral
value (temperature 1, top-k = vocabulary, top-p's cut 0, ...) so running a processor over it leaves it as it was.

The token-dependent state (penalty counts, token history, ban lists) lives in per-slot tables too
(`rollout.engine.sampling.slot_state`), filled at a sample's first draw and kept through preemption and recompute with
its slot. Logit biases have per-slot tables of their own (`rollout.engine.sampling.logit_bias`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

from rollout.config import SamplingParams
from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request
from rollout.engine.sampling.ban_lists import has_bans
from rollout.engine.sampling.draw import uniforms
from rollout.engine.sampling.logit_bias import SlotBias
from rollout.engine.sampling.slot_columns import FLOAT_COLUMNS, INT_COLUMNS, SlotColumns
from rollout.engine.sampling.slot_state import SlotState

_SEED_MASK = (1 << 63) - 1


def stream_seed(seed: int, sample_index: int) -> int:
    """A sample's 63-bit random stream id: a keyed digest of (seed, sample index). Python's `hash` would not do:
    hash(-1) == hash(-2), and integers' hashes wrap modulo 2**61 - 1, so distinct seeds would draw alike."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def features(params: SamplingParams) -> list[str]:
    """The processors a request's parameters switch on (what `SamplingSlots.uses` counts)."""
    used = ["greedy" if params.greedy else "sampled"]
    if params.logit_bias:
        used.append("logit_bias")
    if params.top_k:
        used.append("top_k")
        if not params.greedy:
            used.append("sampled_top_k")
    if params.top_p < 1:
        used.append("top_p")
    if params.min_p > 0:
        used.append("min_p")
    if params.typical_p < 1:
        used.append("typical_p")
    if params.epsilon_cutoff > 0:
        used.append("epsilon_cutoff")
    if params.eta_cutoff > 0:
        used.append("eta_cutoff")
    if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
        used.append("penalties")
    if has_bans(params):
        used.append("bans")
    if params.min_new_tokens:
        used.append("min_new_tokens")
    if params.top_logprobs:
        used.append("top_logprobs")
    used.append(f"logprob_mode:{params.logprob_mode}")
    return used


class SamplingSlots:
    """Slot tables of the running samples' sampling parameters (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64):
        """
        Args:
            vocab_size: the logits' width (top_k is capped at it).
            device: where the tables live.
            capacity: slots allocated at first; the tables double when a sample finds none free.
        """
        self.vocab_size = vocab_size
        self.device = device
        self._floats = torch.zeros(capacity, len(FLOAT_COLUMNS), dtype=torch.float32, device=device)
        self._ints = torch.zeros(capacity, len(INT_COLUMNS), dtype=torch.long, device=device)
        self._free = list(range(capacity - 1, -1, -1))
        # Each slot's stream id (`stream_seed`), on the host: the draws' uniform numbers are made there (`gather`).
        self._seed_bases = np.zeros(capacity, dtype=np.uint64)
        self._pending: list[tuple[int, list[float], list[int]]] = []  # rows written at the next gather
        self.uses: Counter[str] = Counter()  # feature -> live slots that use it
        self._top_ks: Counter[int] = Counter()  # top_k of the live slots that set one
        self._assigned: list[Request] = []  # requests given a slot by the gather under way
        self.state = SlotState(vocab_size, device, capacity)  # penalty counts, token history, ban lists
        self.bias = SlotBias(vocab_size, device, capacity)  # logit_bias
        self._decisions: list[tuple[tuple[str, str], bool | int]] | None = None  # while `recording`
        self._replaying: Iterator[tuple[tuple[str, str], bool | int]] | None = None  # while `as_captured`
        self._frozen_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # while `as_captured`

    @property
    def num_live(self) -> int:
        """Slots held by samples that have not finished."""
        return self._floats.shape[0] - len(self._free)

    def gather(self, requests: list[Request], ahead: list[int] | None = None) -> SlotColumns:
        """The step's columns, one row per request (taking a slot for each request's first draw).

        Args:
            requests: the sampled requests, in row order; each's last token is the one being sampled.
            ahead: per row, how many positions past its request's next token the row samples (None: none).
        """
        host, max_position = self.host_index(requests, ahead)
        return self.columns(to_device(torch.from_numpy(host), torch.long, self.device), max_position)

    def host_index(self, requests: list[Request], ahead: list[int] | None = None) -> tuple[np.ndarray, int]:
        """The rows' index on the host, (3, rows) int64: each row's slot, its position, and its uniform number's
        float64 bits (one copy brings all three to the device); and the largest position. Takes a slot for each
        request's first draw and writes new slots' rows (as `gather`).

        Args:
            requests: the sampled requests, in row order.
            ahead: per row, positions past its request's next token (None: none).
        """
        slots = [r.sampling_slot if r.sampling_slot >= 0 else self._assign(r) for r in requests]
        assigned, self._assigned = self._assigned, []
        # The sampled token's position: the request's length before it (its placeholder, if any, is not there yet).
        positions = [len(r.token_ids) for r in requests]
        if ahead is not None:
            positions = [position + offset for position, offset in zip(positions, ahead, strict=True)]
        self._write_pending()
        if assigned:
            self.state.assign(assigned)
            self.bias.assign(assigned)
        host = np.empty((3, len(slots)), dtype=np.int64)
        host[0], host[1] = slots, positions
        if self.uses["sampled"]:  # greedy rows never read theirs
            host[2] = uniforms(self._seed_bases[host[0]], host[1]).view(np.int64)
        else:
            host[2] = 0
        return host, max(positions)

    def columns(self, index: torch.Tensor, max_position: int) -> SlotColumns:
        """The columns of the rows `index` names (`host_index`'s, on the device).

        Args:
            index: (3, rows) int64: slots, positions, the uniform numbers' bits.
            max_position: the largest position.
        """
        float_table, int_table = self._frozen_tables or (self._floats, self._ints)
        floats = float_table.index_select(0, index[0])
        ints = int_table.index_select(0, index[0])
        return SlotColumns(floats, ints, index[0], index[1], max_position, index[2].view(torch.float64))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameter tables (they move when they grow)."""
        return self._floats, self._ints

    def any(self, feature: str) -> bool:
        """Whether some live slot uses `feature` (see `features`)."""
        return self._decide(("any", feature))

    def all_use(self, feature: str) -> bool:
        """Whether every live slot uses `feature` (a step's rows then need no per-row check of it)."""
        return self._decide(("all_use", feature))

    def one_top_k(self) -> bool:
        """Whether every live slot sets top_k, all to the same value."""
        return self._decide(("one_top_k", ""))

    def max_top_k(self) -> int:
        """The largest top_k that a live slot sets, capped at the vocabulary size (0 when none sets one)."""
        return self._decide(("max_top_k", ""))

    def every_sampled_sets_top_k(self) -> bool:
        """Whether every live slot that samples (not greedy) sets top_k."""
        return self._decide(("every_sampled_sets_top_k", ""))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[tuple[str, str], bool | int]]]:
        """Inside, every decision asked of the live slots (`any`, `all_use`, `one_top_k`, `max_top_k`,
        `every_sampled_sets_top_k`; a pass must ask them nothing else, nor read their counts) is appended,
        with its answer, to the list this yields: what a captured sampling pass depends on (`SamplerGraphs`)."""
        self._decisions = decisions = []
        try:
            yield decisions
        finally:
            self._decisions = None

    def still(self, decisions: list[tuple[tuple[str, str], bool | int]]) -> bool:
        """Whether each of these recorded decisions gets the same answer from the live slots now."""
        return all(self._answer(query) == answer for query, answer in decisions)

    @contextlib.contextmanager
    def as_captured(
        self, decisions: list[tuple[tuple[str, str], bool | int]], tables: tuple[torch.Tensor, torch.Tensor]
    ) -> Iterator[None]:
        """Inside, decisions get their recorded answers (asked in the recorded order) and columns read these
        tables: what a replay of the capture that recorded them computes, whatever the live slots hold now (the
        pass run again where graphs are not captured: CPU tests)."""
        self._replaying, self._frozen_tables = iter(decisions), tables
        try:
            yield
        finally:
            self._replaying = self._frozen_tables = None

    def _decide(self, query: tuple[str, str]) -> bool | int:
        if self._replaying is not None:
            recorded, answer = next(self._replaying)
            if recorded != query:
                raise RuntimeError(f"a captured sampling pass asked {recorded}, its replay {query}")
            return answer
        answer = self._answer(query)
        if self._decisions is not None:
            self._decisions.append((query, answer))
        return answer

    def _answer(self, query: tuple[str, str]) -> bool | int:
        kind, feature = query
        if kind == "any":
            return self.uses[feature] > 0
        if kind == "all_use":
            return self.uses[feature] == self.num_live
        if kind == "one_top_k":
            return len(self._top_ks) == 1 and self.uses["top_k"] == self.num_live
        if kind == "every_sampled_sets_top_k":
            return self.uses["sampled_top_k"] == self.uses["sampled"]
        return min(max(self._top_ks), self.vocab_size) if self._top_ks else 0  # max_top_k

    def release(self, request: Request) -> None:
        """Give back a finished request's slot (no-op when it never drew)."""
        slot = request.sampling_slot
        if slot < 0:
            return
        request.sampling_slot = -1
        # A row still waiting to be written (its step failed before the write) must not land on the slot's next owner.
        self._pending = [entry for entry in self._pending if entry[0] != slot]
        params = request.sampling
        self.uses.subtract(features(params))
        self.state.release(slot)
        self.bias.release(slot)
        if params.top_k:
            self._top_ks[params.top_k] -= 1
            if not self._top_ks[params.top_k]:
                del self._top_ks[params.top_k]
        self._free.append(slot)

    def _assign(self, request: Request) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        request.sampling_slot = slot
        params = request.sampling
        self.uses.update(features(params))
        if params.top_k:
            self._top_ks[params.top_k] += 1
        self._pending.append((slot, _float_row(params), self._int_row(request)))
        self._seed_bases[slot] = stream_seed(request.seed, request.sample_index)
        self._assigned.append(request)
        return slot

    def _int_row(self, request: Request) -> list[int]:
        params = request.sampling
        top_k = min(params.top_k or self.vocab_size, self.vocab_size)
        # min_new_tokens past max_new_tokens masks the stops throughout either way: capped there, it never overflows
        # the int64 table (a row that failed to stage would fail the whole step, other clients' samples with it).
        min_new_tokens = min(params.min_new_tokens, request.max_new_tokens) if request.stop_token_ids else 0
        return [
            top_k,
            int(params.greedy),
            int(params.logprob_mode == "processed"),
            request.num_prompt_tokens,
            min_new_tokens,
            params.no_repeat_ngram_size,  # at most MAX_NO_REPEAT_NGRAM_SIZE (validated)
        ]

    def _write_pending(self) -> None:
        if not self._pending:
            return
        slots = to_device([slot for slot, _, _ in self._pending], torch.long, self.device)
        self._floats.index_copy_(0, slots, to_device([row for _, row, _ in self._pending], torch.float32, self.device))
        self._ints.index_copy_(0, slots, to_device([row for _, _, row in self._pending], torch.long, self.device))
        self._pending.clear()

    def _grow(self) -> None:
        """Double the tables (stream-ordered copies: steps already queued read the old ones)."""
        old = self._floats.shape[0]
        self._floats = torch.cat([self._floats, torch.zeros_like(self._floats)])
        self._ints = torch.cat([self._ints, torch.zeros_like(self._ints)])
        self._seed_bases = np.concatenate([self._seed_bases, np.zeros(old, dtype=np.uint64)])
        self.state.grow(2 * old)
        self.bias.grow(2 * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))


def _float_row(params: SamplingParams) -> list[float]:
    greedy = params.greedy
    divisor = params.temperature if params.logprob_mode == "temperature_scaled" and params.temperature > 0 else 1.0
    values = {
        "temperature": 1.0 if greedy else params.temperature,
        "top_p_cut": 1.0 - params.top_p,  # in double, then fp32: the threshold transformers' warper uses
        "min_p": params.min_p,
        "typical_p": params.typical_p,
        "epsilon_cutoff": params.epsilon_cutoff,
        "eta_cutoff": params.eta_cutoff,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logprob_divisor": divisor,
    }
    return [float(values[name]) for name in FLOAT_COLUMNS]

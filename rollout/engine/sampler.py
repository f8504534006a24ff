"""Per-request logits processing, sampling and log-probs for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.engine.request import Request
from rollout.engine.sampling_slots import SamplingSlots, SlotColumns
from rollout.engine.token_bans import Bans, apply_bans, build_bans, has_bans, record
from rollout.engine.transfer import HostCopy, to_device
from rollout.engine.warpers import warp


@dataclass
class SamplerState:
    """A request's sampling state on the device, kept on `Request.sampler_state` while it runs."""

    seen: torch.Tensor | None = None  # (vocab,) bool: in prompt or output (repetition_penalty)
    counts: torch.Tensor | None = None  # (vocab,) fp32: times generated (presence/frequency penalties)
    bans: Bans | None = None  # step 2 (token_bans)


@dataclass
class SamplerOutput:
    """One entry per sampled row, in `batch.samples` order (plain Python values)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Rows whose bans left no token to draw (their token is meaningless; the engine ends those samples).
    dead_rows: list[int] = field(default_factory=list)


class PendingSamples:
    """A step's sampled tokens: on the device at once (`token_ids`, for the next step's inputs), on the host after
    `fetch()`. Everything the host needs comes down in one copy, queued when the sampling was."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        parts: list[torch.Tensor],
        top_counts: list[int] | None,
        dead: torch.Tensor | None = None,
    ):
        """
        Args:
            token_ids: (rows,) int64 sampled tokens on the device.
            parts: 1-D device tensors brought to the host together: token ids, then (with logprobs) the chosen
                log-probs, then (with top log-probs) the flattened top values and top indices.
            top_counts: per row, how many top log-probs it asked for (None: top log-probs not computed).
            dead: (rows,) bool, rows with no drawable token (None: not checked); copied with the rest, last.
        """
        self.token_ids = token_ids
        self._rows = token_ids.shape[0]
        self._has_logprobs = len(parts) > 1
        self._top_counts = top_counts
        self._checked = dead is not None
        parts = parts if dead is None else [*parts, dead]
        # float64 holds token ids exactly.
        self._host = HostCopy(torch.cat([part.double() for part in parts])) if self._rows else None

    def fetch(self) -> SamplerOutput:
        """The sampled tokens and log-probs as Python values (waits for the copy to land)."""
        if self._host is None:
            return SamplerOutput([], [] if self._has_logprobs else None, None)
        host = self._host.tensor()
        rows = self._rows
        tokens = host[:rows].long().tolist()
        dead_rows = host[-rows:].nonzero().flatten().tolist() if self._checked else []
        if not self._has_logprobs:
            return SamplerOutput(tokens, None, None, dead_rows)
        chosen = host[rows : 2 * rows].tolist()
        top = None
        if self._top_counts is not None:
            width = max(self._top_counts)
            values, indices = (
                host[2 * rows : 2 * rows + rows * width].tolist(),
                host[2 * rows + rows * width :].tolist(),
            )
            top = [
                [(int(indices[i * width + j]), values[i * width + j]) for j in range(self._top_counts[i])]
                for i in range(rows)
            ]
        return SamplerOutput(tokens, chosen, top, dead_rows)


class Sampler:
    """Applies each request's own processors to its logits row, then samples.

    Each sample's parameters live in the per-slot device tables of `rollout.engine.sampling_slots`, written at its
    first draw; a step gathers its rows' columns there. Pipeline order (each step runs only while some running
    sample asks for it; rows that do not ask hold neutral values and come out as they went in):
      1. penalties on the request's own tokens: repetition_penalty (prompt + output, transformers' semantics),
         presence_penalty and frequency_penalty (output tokens, OpenAI semantics);
      2. bans (`rollout.engine.token_bans`): no_repeat_ngram_size, bad_words_ids, suppress_tokens,
         begin_suppress_tokens;
      3. min_new_tokens: stop tokens masked while fewer than min_new_tokens tokens were generated;
      4. temperature; 5. top_k; 6. top_p; 7. min_p; 8. typical_p; 9. epsilon_cutoff; 10. eta_cutoff
         (`rollout.engine.warpers`, transformers' warper semantics);
      11. sample: greedy rows take the argmax; others draw by inverse CDF with one uniform number per row, a
         counter-based hash of (request seed, sample index, position) mixed on the device: a completion never
         depends on the rest of the batch, on preemption, or on any RNG state, and drawing needs no host round trip.

    Log-probs are fp32, in the request's `logprob_mode`:

      processed           log_softmax after step 10: the distribution actually sampled from. For greedy rows
                          (temperature 0 or do_sample=False), after step 3: like transformers' `generate`, which
                          runs its warpers only when sampling (a greedy row's sampled distribution is a point mass,
                          whose log-prob would always be 0).
      raw                 log_softmax of the model's logits, before any step.
      temperature_scaled  log_softmax(logits / temperature) of the model's logits, without penalties, masks or
                          truncation (temperature 0 counts as 1): what a trainer recomputes when it divides its own
                          logits by the sampling temperature (TRL's GRPOTrainer, verl's actors), so their importance
                          ratio measures only numerical train/inference differences.

    `top_logprobs` > 0 also returns that many top entries of the same distribution.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        """
        Args:
            vocab_size: width of the logits rows.
            device: where the logits are (and the per-slot sampling tables live).
        """
        self.vocab_size = vocab_size
        self.slots = SamplingSlots(vocab_size, torch.device(device))

    def release(self, request: Request) -> None:
        """Drop a finished request's sampling state and give back its slot."""
        self.slots.release(request)
        request.sampler_state = None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, samples: list[tuple[Request, int]], return_logprobs: bool) -> PendingSamples:
        """Sample one token for each (request, logits row) pair, without waiting for the device: the work is queued
        and the results come to the host in one copy (`PendingSamples.fetch()`).

        Args:
            logits: (rows, vocab) logits of the positions that get sampled.
            samples: (request, row) pairs; several requests may share a row (a group's first token).
            return_logprobs: compute log-probs (and top log-probs where asked).
        """
        device = logits.device
        if not samples:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return PendingSamples(empty, [empty] * (2 if return_logprobs else 1), None)
        slots = self.slots
        requests = [request for request, _ in samples]
        columns = slots.gather(requests)
        if len(samples) == logits.shape[0]:
            raw = logits.float()  # one sample per row: rows are handed out in order, so sample i reads row i
        else:  # a group's samples share their leader's row for their first token
            raw = logits.float().index_select(0, to_device([row for _, row in samples], torch.long, device))
        # Penalties, bans and min_new_tokens write into the scores in place; `raw` stays the model's logits.
        edits = slots.any("penalties") or slots.any("bans") or slots.any("min_new_tokens")
        scores = raw.clone() if edits else raw
        states = None
        if slots.any("penalties") or slots.any("bans"):
            states = [self._state(request, device) for request in requests]
            self._apply_penalties(scores, columns, states)
            self._apply_bans(scores, requests, states)
        if slots.any("min_new_tokens"):
            self._mask_early_stops(scores, requests)
        # Bans (with min_new_tokens) may leave a row nothing to draw: such rows are flagged, never silently drawn.
        dead = ~torch.isfinite(scores).any(dim=-1) if slots.any("bans") or slots.any("min_new_tokens") else None

        token_ids = scores.argmax(dim=-1) if slots.any("greedy") or not slots.any("sampled") else None
        if slots.any("sampled"):
            # Greedy rows keep their unwarped scores and their argmax (transformers warps only when sampling).
            warped = warp(scores, columns, slots)
            drawn = sample_from(warped.softmax(dim=-1), columns.seeds())
            if slots.any("greedy"):
                greedy = columns.int("greedy").bool()
                scores = torch.where(greedy.unsqueeze(1), scores, warped)
                token_ids = torch.where(greedy, token_ids, drawn)
            else:
                scores, token_ids = warped, drawn
        if states is not None:
            self._record(requests, states, token_ids)

        if not return_logprobs:
            return PendingSamples(token_ids, [token_ids], None, dead)
        logprobs = torch.log_softmax(self._logprob_source(raw, scores, columns), dim=-1)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if not slots.any("top_logprobs"):
            return PendingSamples(token_ids, [token_ids, chosen], None, dead)
        top_counts = [request.sampling.top_logprobs for request in requests]
        if not max(top_counts):
            return PendingSamples(token_ids, [token_ids, chosen], None, dead)
        values, indices = logprobs.topk(max(top_counts), dim=-1)
        return PendingSamples(token_ids, [token_ids, chosen, values.flatten(), indices.flatten()], top_counts, dead)

    def _logprob_source(self, raw: torch.Tensor, scores: torch.Tensor, columns: SlotColumns) -> torch.Tensor:
        """The logits each row's log-probs are the log_softmax of, by its logprob_mode (see the class docstring)."""
        slots = self.slots
        if not slots.any("logprob_mode:raw") and not slots.any("logprob_mode:temperature_scaled"):
            return scores
        unprocessed = raw
        if slots.any("logprob_mode:temperature_scaled"):
            unprocessed = raw / columns.float("logprob_divisor")
        if not slots.any("logprob_mode:processed"):
            return unprocessed
        return torch.where(columns.int("use_processed").bool().unsqueeze(1), scores, unprocessed)

    def _mask_early_stops(self, scores: torch.Tensor, requests: list[Request]) -> None:
        """min_new_tokens: stop tokens get -inf while fewer than min_new_tokens tokens were generated."""
        rows: list[int] = []
        columns: list[int] = []
        for i, request in enumerate(requests):
            if request.num_output_tokens < request.sampling.min_new_tokens and request.stop_token_ids:
                rows += [i] * len(request.stop_token_ids)
                columns += request.stop_token_ids
        if rows:
            index = to_device([rows, columns], torch.long, scores.device)
            scores.index_put_((index[0], index[1]), scores.new_full((), float("-inf")))

    def _state(self, request: Request, device: torch.device) -> SamplerState | None:
        """The request's device state, built at its first draw (when all its tokens are on the host); None when its
        processors need none."""
        if request.sampler_state is not None:
            return request.sampler_state
        params = request.sampling
        penalized = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
        if penalized or has_bans(params):
            if request.has_placeholder:
                raise RuntimeError(f"sampler state of {request.request_id} built before its last token was resolved")
            state = SamplerState()
            if penalized:
                state.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
                state.seen.index_fill_(0, to_device(request.token_ids, torch.long, device), True)
                output = to_device(request.output_ids, torch.long, device)
                counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
                # index_add_, not bincount: bincount on CUDA reads the largest id back to the host.
                state.counts = counts.index_add_(0, output, torch.ones_like(output, dtype=counts.dtype))
            if has_bans(params):
                state.bans = build_bans(request, device)
            request.sampler_state = state
        return request.sampler_state

    @staticmethod
    def _apply_penalties(scores: torch.Tensor, columns: SlotColumns, states: list[SamplerState | None]) -> None:
        rows = [i for i, state in enumerate(states) if state is not None and state.seen is not None]
        if not rows:
            return
        seen = torch.stack([states[i].seen for i in rows])
        counts = torch.stack([states[i].counts for i in rows])
        index = to_device(rows, torch.long, scores.device)
        sub = scores.index_select(0, index)
        repetition = columns.float("repetition_penalty").index_select(0, index)
        presence = columns.float("presence_penalty").index_select(0, index)
        frequency = columns.float("frequency_penalty").index_select(0, index)
        sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
        sub = sub - presence * (counts > 0) - frequency * counts
        scores.index_copy_(0, index, sub)

    @staticmethod
    def _apply_bans(scores: torch.Tensor, requests: list[Request], states: list[SamplerState | None]) -> None:
        """Step 2, on the rows of requests that ban tokens (one attribute check per row otherwise)."""
        for i, request in enumerate(requests):
            state = states[i]
            if state is not None and state.bans is not None:
                apply_bans(scores[i], state.bans, request.num_tokens, request.num_output_tokens)

    @staticmethod
    def _record(requests: list[Request], states: list[SamplerState | None], token_ids: torch.Tensor) -> None:
        """Count / append each drawn token in its request's device state. index_fill_/index_add_ with a one-element
        index tensor: indexing with a 0-dim device tensor (`seen[token] = True`) would read the index back to the
        host."""
        for index, (request, state) in enumerate(zip(requests, states)):
            if state is None:
                continue
            token = token_ids[index : index + 1]
            if state.seen is not None:
                state.seen.index_fill_(0, token, True)
                state.counts.index_add_(0, token, torch.ones(1, dtype=state.counts.dtype, device=state.counts.device))
            if state.bans is not None:
                record(state.bans, request.num_tokens, token)


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch multiplies by (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_MIX_1, _MIX_2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def uniform_from_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per seed (float64, 52 random bits), a pure function of the seed: SplitMix64's
    finaliser (products wrap around 64 bits, as its arithmetic modulo 2^64 wants), in a dozen element-wise ops.

    Args:
        seeds: (rows,) int64 seeds (already mixed from request seed, sample index and position).
    """
    z = (seeds ^ _shift_right(seeds, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 12).to(torch.float64) + 0.5) * 2.0**-52


def sample_from(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Draw one column per row of `probs` (rows need not be normalised) with the uniform of its seed: the first
    column whose cumulative probability reaches u * total, so a zero-probability column is never drawn.

    Args:
        probs: (rows, vocab) non-negative weights.
        seeds: (rows,) int64 seeds.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform_from_seeds(seeds).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)

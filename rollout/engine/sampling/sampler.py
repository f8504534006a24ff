"""Per-request logits processing, sampling and log-probs for one engine step."""

from __future__ import annotations

import torch

from rollout.engine.grammar.constraints import GrammarMasks
from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request
from rollout.engine.sampling.ban_masks import mask_bans
from rollout.engine.sampling.draw import sample_blocked, sample_from
from rollout.engine.sampling.pending_samples import PendingSamples, pack, row_faults
from rollout.engine.sampling.sampled_logprobs import Candidates, sampled_logprobs
from rollout.engine.sampling.sampler_graphs import SamplerGraphs
from rollout.engine.sampling.slot_columns import SlotColumns
from rollout.engine.sampling.slots import SamplingSlots
from rollout.engine.sampling.warpers import candidate_width, warp, warp_candidates

__all__ = ["Sampler"]


class Sampler:
    """Applies each request's own processors to its logits row, then samples.

    Each sample's parameters live in the per-slot device tables of `rollout.engine.sampling.slots`, written at its
    first draw; a step gathers its rows' columns there. Pipeline order (each step runs only while some running
    sample asks for it; rows that do not ask hold neutral values and come out as they went in):
      0. logit_bias added to the model's logits (`rollout.engine.sampling.logit_bias`), before anything else, as vLLM
         (and transformers' sequence_bias) apply it: the penalties below see the biased logits;
      1. penalties on the request's own tokens: repetition_penalty (prompt + output, transformers' semantics),
         presence_penalty and frequency_penalty (output tokens, OpenAI semantics);
      2. bans: no_repeat_ngram_size, bad_words_ids, suppress_tokens, begin_suppress_tokens;
      3. min_new_tokens: stop tokens masked while fewer than min_new_tokens tokens were generated;
         3b. structured outputs: a constrained row's grammar masks every token it does not allow next
         (`rollout.engine.grammar.constraints`; a row it leaves nothing is ended with an error naming the constraint);
         a row whose model logits are not finite (NaN or +Inf: an adapter or the model overflowed) is flagged before
         any of these and its sample ended with an error naming the adapter (or the base model);
      4. temperature; 5. top_k; 6. top_p; 7. min_p; 8. typical_p; 9. epsilon_cutoff; 10. eta_cutoff
         (`rollout.engine.sampling.warpers`, transformers' warper semantics);
      11. sample (`rollout.engine.sampling.draw`): greedy rows take the argmax; others draw by inverse CDF with one
         uniform number per row, a counter-based hash of (request seed, sample index, position) made on the host
         with the step's slot indices (SplitMix64) and copied with them: a completion never depends on the rest of
         the batch, on preemption, or on any RNG state, and drawing needs no host round trip.

    Steps 1-3 read each sample's tokens from per-slot device tables (`rollout.engine.sampling.slot_state`, masks in
    `rollout.engine.sampling.ban_masks`): a fixed number of kernels per step for all rows, and one scatter per table to
    record the drawn tokens. When every sampling row sets top_k, steps 4-11 run on each row's top candidates
    (`warpers.warp_candidates`, in token id order: the same CDF as the whole row's), else on whole rows with a
    blocked CDF walk; log-probs are a gathered score minus its row's logsumexp (no log_softmax of whole rows).

    Log-probs are fp32, in the request's `logprob_mode`:

      processed           log_softmax after step 10: the distribution actually sampled from (logit_bias and a
                          grammar's mask included).
                          For greedy rows (temperature 0 or do_sample=False), after step 3: like transformers'
                          `generate`, which runs its warpers only when sampling (a greedy row's sampled
                          distribution is a point mass, whose log-prob would always be 0).
      raw                 log_softmax of the model's logits, before any step (logit_bias not included, as vLLM's
                          raw_logprobs).
      temperature_scaled  log_softmax(logits / temperature) of the model's logits, without logit_bias, penalties,
                          masks or truncation (temperature 0 counts as 1): what a trainer recomputes when it divides
                          its own logits by the sampling temperature (TRL's GRPOTrainer, verl's actors), so their
                          importance ratio measures only numerical train/inference differences.

    `top_logprobs` > 0 also returns that many top entries of the same distribution.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", batch_invariant: bool = False):
        """
        Args:
            vocab_size: width of the logits rows.
            device: where the logits are (and the per-slot sampling tables live).
            batch_invariant: whole-row log-probs as a trainer computes them, `torch.log_softmax` of the row then
                gathered (bit for bit the trainer's), not a gathered score minus the row's logsumexp (which rounds
                differently); and whole rows drawn from, never top-k candidates (which serve or not depending on the
                other live samples).
        """
        self.vocab_size = vocab_size
        self.batch_invariant = batch_invariant
        self.slots = SamplingSlots(vocab_size, torch.device(device))
        self.grammar_masks = GrammarMasks()  # structured outputs' constrained rows
        self.graphs: SamplerGraphs | None = None  # captured passes (`enable_graphs`)

    def release(self, request: Request) -> None:
        """Drop a finished request's sampling state and give back its slot."""
        self.slots.release(request)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        samples: list[tuple[Request, int]],
        return_logprobs: bool,
        ahead: list[int] | None = None,
    ) -> PendingSamples:
        """Sample one token for each (request, logits row) pair, without waiting for the device: the work is queued
        and the results come to the host in one copy (`PendingSamples.fetch()`).

        Args:
            logits: (rows, vocab) logits of the positions that get sampled.
            samples: (request, row) pairs; several requests may share a row (a group's first token).
            return_logprobs: compute log-probs (and top log-probs where asked).
            ahead: draws ahead of the requests' tokens (speculative decoding's draft positions), one count per pair:
                pair i draws the token at `ahead[i]` positions past its request's next one (0: the next one), as if
                the tokens between were its own; a request may appear in several pairs. Only a request that keeps no
                token-dependent state may draw ahead (`verify.draws_ahead`): its draws are recorded like any other,
                in table rows it never reads. None: every pair draws its request's next token.
        """
        device = logits.device
        if not samples:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return PendingSamples(empty, [empty] * (2 if return_logprobs else 1), None)
        slots = self.slots
        requests = [request for request, _ in samples]
        host_index, max_position = slots.host_index(requests, ahead)  # slots taken: every decision below sees them
        grammars = [request.constraint for request in requests]
        constrained = any(state is not None for state in grammars)
        top_counts = None
        if return_logprobs and slots.any("top_logprobs"):
            top_counts = [request.sampling.top_logprobs for request in requests]
            top_counts = top_counts if max(top_counts) else None
        # Sample i reads row i (the usual step: one row per sample, in order): the rows are used as they are.
        # Otherwise each sample's row is picked (a group's samples share their leader's row for their first token;
        # a drafted step has a row per draft token; draws ahead read draft rows). Equal counts alone do not say
        # which: a drafted step's rows may number its samples by chance.
        one_per_row = (
            ahead is None
            and len(samples) == logits.shape[0]
            and all(row == index for index, (_, row) in enumerate(samples))
        )
        picked = logits if one_per_row else None
        if not constrained and self.graphs is not None and self._graphable():
            if picked is None:
                picked = logits.index_select(0, to_device([row for _, row in samples], torch.long, device))
            pending = self.graphs.sample(self._graph_pass, picked, host_index, top_counts, return_logprobs)
            if pending is not None:
                return pending
        columns = slots.columns(to_device(torch.from_numpy(host_index), torch.long, device), max_position)
        if picked is not None:
            raw = picked.float()
        else:
            raw = logits.float().index_select(0, to_device([row for _, row in samples], torch.long, device))
        top_width = max(top_counts) if top_counts else 0
        token_ids, parts, faults = self._pass(
            raw, columns, grammars if constrained else None, top_width, return_logprobs
        )
        return PendingSamples(token_ids, parts, top_counts, faults)

    def _pass(
        self,
        raw: torch.Tensor,
        columns: SlotColumns,
        grammars: list | None,
        top_width: int,
        return_logprobs: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The sampling pass on the device, every row at once: (token ids, the parts the host reads (`PendingSamples`),
        each row's fault code). Its host decisions are asked of the live slots (`SamplingSlots.recording`).

        Args:
            raw: (rows, vocab) fp32 model logits, one row per sample.
            columns: the rows' sampling parameters.
            grammars: each row's grammar state (None: no row is constrained).
            top_width: the most top log-probs a row asks for (0: none).
            return_logprobs: compute log-probs.
        """
        slots = self.slots
        # A row whose model logits hold NaN or +Inf, or nothing above -Inf, is flagged (one reduction per row, brought
        # to the host with the tokens): its sample ends with an error, never a meaningless token (amax propagates NaN).
        broken = ~torch.isfinite(raw.amax(dim=-1))
        # Penalties, bans, min_new_tokens and grammars write into the scores in place; `raw` stays the model's logits.
        constrained = grammars is not None
        banned = slots.any("bans") or slots.any("min_new_tokens") or constrained
        if slots.any("logit_bias"):  # step 0: a new tensor
            scores = slots.bias.apply(raw, columns)
        else:
            scores = raw.clone() if banned or slots.any("penalties") else raw
        if slots.any("penalties"):
            scores = slots.state.penalize(scores, columns)
        if banned:
            mask_bans(scores, slots.state, columns)
        if constrained:  # step 3b: each constrained row's grammar masks what it does not allow next
            self.grammar_masks(scores, grammars)
        # Bans (with min_new_tokens) may leave a row nothing to draw: such rows are flagged, never silently drawn.
        dead = ~torch.isfinite(scores).any(dim=-1) if banned else None
        faults = row_faults(broken, dead)
        candidates = None
        if self._candidates(top_width):
            token_ids, candidates = self._draw_candidates(scores, columns, top_width)
        else:
            token_ids, scores = self._draw_whole_rows(scores, columns)
        slots.state.record(columns, token_ids)

        if not return_logprobs:
            return token_ids, [token_ids], faults
        chosen, top = sampled_logprobs(
            slots, raw, scores, columns, token_ids, candidates, top_width, self.batch_invariant
        )
        if top is None:
            return token_ids, [token_ids, chosen], faults
        values, indices = top
        return token_ids, [token_ids, chosen, values.flatten(), indices.flatten()], faults

    def _graphable(self) -> bool:
        """Whether a captured pass may serve: it reads no table but the parameter tables (no logit_bias, penalty,
        ban or min_new_tokens among the live samples, whose tables come and go)."""
        uses, state = self.slots.uses, self.slots.state
        if uses["logit_bias"] or uses["penalties"] or uses["bans"] or uses["min_new_tokens"]:
            return False
        return state.seen is None and state.history is None

    def _graph_pass(
        self, logits: torch.Tensor, index: torch.Tensor, top_width: int, return_logprobs: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass a sampler graph captures (`SamplerGraphs`): (token ids, everything the host reads, packed)."""
        columns = self.slots.columns(index, 0)  # no ban reads a position's history in a graphed pass
        token_ids, parts, faults = self._pass(logits.float(), columns, None, top_width, return_logprobs)
        return token_ids, pack(parts, faults)

    def enable_graphs(self, buckets: list[int], capture: bool = True) -> SamplerGraphs:
        """Serve the steps that fit through captured sampling passes (`SamplerGraphs`; the engine does this where its
        decode steps replay CUDA graphs).

        Args:
            buckets: the row counts that get a graph (a step's rows are padded up to one).
            capture: False runs each pass again on the graphs' buffers instead of replaying it (CPU tests).
        """
        self.graphs = SamplerGraphs(self.slots, buckets, capture)
        return self.graphs

    def release_graphs(self) -> None:
        """Free the captured passes and their memory (captured again when next used)."""
        if self.graphs is not None:
            self.graphs.release()

    def _candidates(self, top_width: int) -> bool:
        """Whether the step draws from candidates: every live sampling slot sets top_k, and the candidates are
        fewer than the vocabulary (else a whole row costs less)."""
        slots = self.slots
        # Batch-invariant: whole rows always. Whether candidates serve depends on which samples are live, and their
        # log-probs round differently from a whole row's.
        if self.batch_invariant or not slots.any("sampled") or not slots.every_sampled_sets_top_k():
            return False
        return candidate_width(slots, top_width) < self.vocab_size

    def _draw_whole_rows(self, scores: torch.Tensor, columns: SlotColumns) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 4-11 on whole rows, drawn by a blocked CDF walk: (token ids, the scores each row's "processed"
        log-probs come from)."""
        slots = self.slots
        token_ids = scores.argmax(dim=-1) if slots.any("greedy") or not slots.any("sampled") else None
        if not slots.any("sampled"):
            return token_ids, scores
        # Greedy rows keep their unwarped scores and their argmax (transformers warps only when sampling).
        warped = warp(scores, columns, slots)
        drawn = sample_blocked(warped.softmax(dim=-1), columns.uniform)
        if not slots.any("greedy"):
            return drawn, warped
        greedy = columns.int("greedy").bool()
        return torch.where(greedy, token_ids, drawn), torch.where(greedy.unsqueeze(1), scores, warped)

    def _draw_candidates(
        self, scores: torch.Tensor, columns: SlotColumns, top_logprobs: int
    ) -> tuple[torch.Tensor, Candidates]:
        """Steps 4-11 on each row's top candidates (every sampling row sets top_k): the token ids, and the
        candidates their "processed" log-probs come from (greedy rows keep their argmax of `scores`)."""
        width = candidate_width(self.slots, top_logprobs)
        values, ids = warp_candidates(scores, columns, self.slots, width)
        # Candidates in token id order: the same CDF as the whole row's, without its zero-probability columns.
        position = sample_from(values.softmax(dim=-1), columns.uniform)
        token_ids = ids.gather(1, position.unsqueeze(1)).squeeze(1)
        if self.slots.any("greedy"):
            token_ids = torch.where(columns.int("greedy").bool(), scores.argmax(dim=-1), token_ids)
        return token_ids, Candidates(values, ids, position)

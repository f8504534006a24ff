"""Per-request logits processing, sampling and log-probs for one engine step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.config import SamplingParams
from rollout.engine.request import Request

_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplerOutput:
    """One entry per sampled row, in `batch.samples` order (plain Python values)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Applies each request's own processors to its logits row, then samples.

    Pipeline order (each step only for the rows that ask for it):
      1. penalties on the request's own tokens: repetition_penalty (prompt + output, transformers' semantics),
         presence_penalty and frequency_penalty (output tokens, OpenAI semantics);
      2. min_new_tokens: stop tokens masked while fewer than min_new_tokens tokens were generated;
      3. temperature; 4. top_k; 5. top_p; 6. min_p (transformers' warper semantics);
      7. sample: greedy rows take the argmax; others draw by the exponential race argmax(p / E), E ~ Exp(1), with E
         drawn from a generator seeded by (request seed, sample index, position) alone, so a completion never
         depends on the rest of the batch, on preemption, or on the global RNG.

    Log-probs are fp32. "processed": log_softmax after step 6 (the distribution actually sampled from; for greedy
    rows, after step 2, as temperature and truncation do not change the argmax). "raw": log_softmax of the model's
    logits. `top_logprobs` > 0 also returns that many top entries of the same distribution.
    """

    def __init__(self, vocab_size: int):
        """
        Args:
            vocab_size: width of the logits rows.
        """
        self.vocab_size = vocab_size
        # One generator per device, re-seeded per row: randomness depends on (seed, sample, position) only.
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, samples: list[tuple[Request, int]], return_logprobs: bool) -> SamplerOutput:
        """Sample one token for each (request, logits row) pair.

        Args:
            logits: (rows, vocab) logits of the positions that get sampled.
            samples: (request, row) pairs; several requests may share a row (a group's first token).
            return_logprobs: compute log-probs (and top log-probs where asked).
        """
        if not samples:
            return SamplerOutput([], [] if return_logprobs else None, None)
        requests = [request for request, _ in samples]
        params = [request.sampling for request in requests]
        rows = torch.tensor([row for _, row in samples], dtype=torch.long, device=logits.device)
        raw = logits.float().index_select(0, rows)
        scores = raw.clone()
        self._apply_penalties(scores, requests)
        for i, request in enumerate(requests):
            if request.num_output_tokens < request.sampling.min_new_tokens and request.stop_token_ids:
                scores[i, list(request.stop_token_ids)] = float("-inf")

        sampling_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = scores.argmax(dim=-1)
        if sampling_rows:
            index = torch.tensor(sampling_rows, device=scores.device)
            warped = self._warp(scores.index_select(0, index), [params[i] for i in sampling_rows])
            scores[index] = warped
            token_ids[index] = self._draw(warped, [requests[i] for i in sampling_rows])
        self._update_penalty_state(requests, token_ids)

        if not return_logprobs:
            return SamplerOutput(token_ids.tolist(), None, None)
        use_raw = torch.tensor([p.logprob_mode == "raw" for p in params], device=scores.device).unsqueeze(1)
        logprobs = torch.log_softmax(torch.where(use_raw, raw, scores), dim=-1)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        top = None
        max_top = max(p.top_logprobs for p in params)
        if max_top:
            values, indices = logprobs.topk(max_top, dim=-1)
            values, indices = values.tolist(), indices.tolist()
            top = [list(zip(indices[i][: p.top_logprobs], values[i][: p.top_logprobs])) for i, p in enumerate(params)]
        return SamplerOutput(token_ids.tolist(), chosen, top)

    def _apply_penalties(self, scores: torch.Tensor, requests: list[Request]) -> None:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling.repetition_penalty != 1 or r.sampling.presence_penalty or r.sampling.frequency_penalty
        ]
        if not rows:
            return
        states = [self._penalty_state(requests[i]) for i in rows]
        seen = torch.stack([s[0] for s in states]).to(scores.device)
        counts = torch.stack([s[1] for s in states]).to(scores.device)
        params = [requests[i].sampling for i in rows]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], device=scores.device).unsqueeze(1)

        index = torch.tensor(rows, device=scores.device)
        sub = scores.index_select(0, index)
        repetition = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
        sub = sub - column("presence_penalty") * (counts > 0) - column("frequency_penalty") * counts
        scores[index] = sub

    def _penalty_state(self, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen in prompt or output, count in output) over the vocabulary; built once, then updated per token."""
        if request.sampler_state is None:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            seen[torch.tensor(request.token_ids)] = True
            counts = torch.bincount(torch.tensor(request.output_ids, dtype=torch.long), minlength=self.vocab_size)
            request.sampler_state = (seen, counts.float())
        return request.sampler_state

    def _update_penalty_state(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        for request, token in zip(requests, token_ids.tolist()):
            if request.sampler_state is not None:
                seen, counts = request.sampler_state
                seen[token] = True
                counts[token] += 1

    def _warp(self, scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Steps 3-6 on the sampling rows (same semantics as transformers' warpers)."""
        device = scores.device
        temperature = torch.tensor([p.temperature for p in params], device=device, dtype=scores.dtype).unsqueeze(1)
        scores = scores / temperature
        if any(p.top_k for p in params):
            k = torch.tensor([min(p.top_k or self.vocab_size, self.vocab_size) for p in params], device=device)
            kth = scores.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=scores.dtype).unsqueeze(1)
            sorted_scores, sorted_index = scores.sort(dim=-1, descending=False)
            remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
            remove[:, -1] = False
            scores = scores.masked_fill(remove.scatter(1, sorted_index, remove), float("-inf"))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=scores.dtype).unsqueeze(1)
            probs = scores.softmax(dim=-1)
            scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return scores

    def _draw(self, scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exponential-race sampling with per-request, per-position noise."""
        generator = self._generators.get(scores.device)
        if generator is None:
            generator = self._generators[scores.device] = torch.Generator(device=scores.device)
        noise = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        for i, request in enumerate(requests):
            seed = hash((request.seed, request.sample_index, request.num_tokens)) & _SEED_MASK
            noise[i].exponential_(generator=generator.manual_seed(seed))
        return (scores.softmax(dim=-1) / noise).argmax(dim=-1)

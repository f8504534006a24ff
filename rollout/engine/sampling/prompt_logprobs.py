"""Prompt log-probs (vLLM's `SamplingParams.prompt_logprobs`), computed in the prefill forward that runs anyway.

For a request that asks for them, every prefill chunk scores its own positions: the logits at position p give
log p(prompt[p + 1] | prompt[:p + 1]) (position 0 has none), in fp32 from the model's raw logits (a log_softmax: no
temperature, penalties or other processors, as vLLM computes prompt log-probs), with the top-k (token, log-prob)
pairs. Only these small results are kept (one float and k pairs per position). The logits are made from the
decoder's last hidden state through the model's output head a slice of rows at a time (`MAX_SLICE_ELEMENTS` fp32
rows x vocab at most), never as one (chunk, vocab) tensor. They come down to the host in one copy queued with the
step, and the engine appends them to the request when it resolves that step (`deliver`).

- Chunked prefill: the request's lists grow chunk by chunk, in order; its first output carries them complete.
- Prefix caching: a request whose prompt is not fully scored takes no cached blocks (`BlockManager.match_prefix`),
  so every prompt token runs through the model (vLLM does the same). Its own blocks are still offered to others.
- Preemption with recompute re-runs the prompt: positions already scored are skipped, when planning and again when
  delivering, so none is returned twice.
- A group of n samples: the leader scores the prompt once; the samples forked from it share its lists.
- Decode steps never score (a step that scores has a multi-token chunk, or one that samples nothing), so the CUDA
  graphs and the compiled decode forward never see this: a scoring step runs the eager forward.

The head's logits are meant to be the causal LM's own: `head(hidden)`, then what transformers' causal LMs apply after
it (Gemma's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling). The first step that scores and
also samples checks this against the model's own logits of its sampled rows; a model whose logits it does not
reproduce gets an error for prompt log-probs instead of wrong values (that step's requests end with an error, and
later requests with prompt log-probs are refused when submitted).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.config import FieldError
from rollout.engine.kv.transfer import HostCopy, to_device
from rollout.engine.lora.layers import LoraStepState
from rollout.engine.requests.request import Request
from rollout.engine.sampling.sampled_logprobs import top_entries
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.invariant.mode import InvariantLinearMode
from rollout.invariant.reductions import invariant_log_softmax

logger = logging.getLogger(__name__)

# Most fp32 logits (rows x vocab) made at once while scoring a chunk: 64 MiB (about 110 rows of a 151k vocabulary).
MAX_SLICE_ELEMENTS = 1 << 24
UNSUPPORTED_HEAD = (
    "prompt_logprobs: this model's logits could not be reproduced from its decoder's last hidden state and output "
    "head (an unknown transform after the head, or no get_decoder()); prompt log-probs are not available for it"
)


@dataclass
class PromptRows:
    """The prompt positions one step scores (host values): runs of consecutive positions, one per request."""

    requests: list[Request] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)  # prompt position scored by the run's first row
    counts: list[int] = field(default_factory=list)  # positions in the run
    tops: list[int] = field(default_factory=list)  # top-k pairs the run's request wants
    rows: list[int] = field(default_factory=list)  # packed input positions whose logits score, every run in order
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores


def plan_prompt_rows(batch: ScheduledBatch) -> PromptRows | None:
    """Which packed positions of a step score which prompt tokens (None: nothing to score, the usual case).

    A chunk [start, start + n) of a request with prompt log-probs scores prompt positions start + 1 .. start + n
    (each from the logits one position earlier), up to the prompt's last, skipping those already scored (a
    recomputed prompt)."""
    plan = PromptRows()
    offset = 0
    for seq in batch.sequences:
        request = seq.request
        scored = request.prompt_logprobs
        if scored is not None:
            first = max(seq.start + 1, len(scored))
            end = min(seq.start + seq.num_tokens + 1, request.num_prompt_tokens)
            if first < end:
                plan.requests.append(request)
                plan.firsts.append(first)
                plan.counts.append(end - first)
                plan.tops.append(request.sampling.prompt_logprobs)
                row = offset - seq.start - 1  # packed row of the logits that score position `first` is row + first
                plan.rows.extend(range(row + first, row + end))
                plan.targets.extend(request.token_ids[first:end])
        offset += seq.num_tokens
    return plan if plan.requests else None


class PendingPromptLogprobs:
    """A step's prompt log-probs on their way to the host (one copy, queued with the step)."""

    def __init__(self, plan: PromptRows, width: int, values: torch.Tensor):
        """
        Args:
            plan: what the step scored.
            width: top-k pairs computed per row (the largest any run wants).
            values: float64, the chosen log-probs, their ranks, then the top values and top ids (row-major, `width`
                per row).
        """
        self.plan = plan
        self.width = width
        self._copy = HostCopy(values)

    def deliver(self) -> None:
        """Append the values to their requests' lists (waits for the copy), skipping positions they already have."""
        host = self._copy.tensor()
        plan, width = self.plan, self.width
        total = len(plan.rows)
        chosen = host[:total].tolist()
        ranks = host[total : 2 * total].long().tolist()
        if width:
            top_values = host[2 * total : total * (2 + width)].view(total, width).tolist()
            top_ids = host[total * (2 + width) :].long().view(total, width).tolist()
        row = 0
        for request, first, count, top in zip(plan.requests, plan.firsts, plan.counts, plan.tops):
            scored = request.prompt_logprobs
            skip = len(scored) - first
            if skip < 0:  # an earlier chunk's values never arrived (its step failed): leave the list incomplete
                logger.warning("prompt log-probs of %s lost a chunk; its outputs carry none", request.request_id)
            elif skip < count:
                scored.extend(chosen[row + skip : row + count])
                request.prompt_logprob_ranks.extend(ranks[row + skip : row + count])
                request.prompt_top_logprobs.extend(
                    list(zip(top_ids[i][:top], top_values[i][:top])) if top else []
                    for i in range(row + skip, row + count)
                )
            row += count


def deliver(pending: PendingPromptLogprobs | None) -> None:
    """`pending.deliver()` when a step scored anything."""
    if pending is not None:
        pending.deliver()


class PromptScorer:
    """Scores prompt positions for one model runner: a hook on the model's decoder keeps the step's last hidden
    state while (and only while) a scoring step runs, and the rows to score go through the output head in slices."""

    def __init__(
        self,
        model: torch.nn.Module,
        text_config: Any,
        adapters: LoraStepState | None = None,
        batch_invariant: bool = False,
    ):
        """
        Args:
            model: the transformers causal LM (its decoder gets a forward hook, removed by `close`).
            text_config: its text config (vocabulary size and the transforms after the head).
            adapters: the runner's LoRA step state: told which token each row sent through the head is (an
                adapter's copy of the head scores its own tokens' rows).
            batch_invariant: the head in `rollout.invariant`'s tiles and log-probs as `log_softmax` then gathered,
                the trainer's expression (not a score minus the row's logsumexp, which rounds differently).
        """
        self.model = model
        self.batch_invariant = batch_invariant
        self.adapters = adapters
        self.vocab_size = text_config.vocab_size
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.logit_scale = getattr(text_config, "logit_scale", None)
        self.logits_scaling = getattr(text_config, "logits_scaling", None)
        self.verified: bool | None = None  # the head reproduces the model's logits (None: not checked yet)
        self._armed = False
        self._hidden: torch.Tensor | None = None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        usable = isinstance(decoder, torch.nn.Module) and decoder is not model
        # The hook stays put for the runner's life and acts only inside a scoring step (one added per step would
        # invalidate the compiled decode forward's guards); it holds this object, not the runner.
        self._hook = decoder.register_forward_hook(self._capture) if usable else None

    def _capture(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if self._armed:
            hidden = getattr(output, "last_hidden_state", None)
            self._hidden = output[0] if hidden is None else hidden

    def admit(self, request: Request) -> None:
        """Refuse a request with prompt log-probs once this model is known not to give them (no decoder to hook, or
        its logits not reproduced: the step that found out ended its requests with an error).

        Raises:
            FieldError: ("prompt_logprobs") UNSUPPORTED_HEAD.
        """
        if request.prompt_logprobs is not None and (self._hook is None or self.verified is False):
            raise FieldError("prompt_logprobs", UNSUPPORTED_HEAD.removeprefix("prompt_logprobs: "))

    def close(self) -> None:
        """Remove the decoder hook. Idempotent."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def run(
        self, forward: Callable[..., torch.Tensor], args: tuple, plan: PromptRows
    ) -> tuple[torch.Tensor, PendingPromptLogprobs]:
        """Run the step's forward (`forward(*args)`, args ending with the rows to keep) keeping its last hidden
        state, then score `plan`'s rows.

        Returns:
            (the forward's logits, the step's prompt log-probs on their way to the host).
        Raises:
            RuntimeError: the model's logits cannot be reproduced from its head (UNSUPPORTED_HEAD).
        """
        if self._hook is None or self.verified is False:
            raise RuntimeError(UNSUPPORTED_HEAD)
        self._armed = True
        try:
            logits = forward(*args)
            hidden = self._hidden
        finally:
            self._armed, self._hidden = False, None
        if hidden is None:
            raise RuntimeError(UNSUPPORTED_HEAD)
        hidden = hidden.reshape(-1, hidden.shape[-1])  # (packed tokens, hidden size)
        keep = args[-1]
        if self.verified is None and keep.numel():
            self._verify(hidden.index_select(0, keep), keep, logits)
        return logits, self._score(hidden, plan)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of some rows of the decoder's last hidden state, as the causal LM makes them.

        Args:
            hidden: the rows (R, hidden size).
            rows: the packed token of each (R,).
        """
        if self.adapters is not None:
            self.adapters.head_rows = rows  # until the next forward sets its own
        logits = self.model.get_output_embeddings()(hidden)  # the fp32 head's and saved heads' hooks apply in a step
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling:
            logits = logits / self.logits_scaling
        return logits.float()

    def _verify(self, hidden: torch.Tensor, rows: torch.Tensor, model_logits: torch.Tensor) -> None:
        """Check (once) that `logits` reproduces the model's own logits of the same rows (packed tokens `rows`), up
        to its dtype's rounding; waits for the device."""
        ours = self.logits(hidden, rows)
        self.verified = False
        if ours.shape == model_logits.shape:
            theirs = model_logits.float()
            tolerance = max(2 * torch.finfo(model_logits.dtype).eps, 1e-4) * float(theirs.abs().max()) + 1e-6
            self.verified = float((ours - theirs).abs().max()) <= tolerance
        if not self.verified:
            raise RuntimeError(UNSUPPORTED_HEAD)

    def _score(self, hidden: torch.Tensor, plan: PromptRows) -> PendingPromptLogprobs:
        """Log-probs of the planned targets and the top-k pairs, a slice of rows at a time; nothing of vocabulary
        size outlives its slice."""
        device = hidden.device
        rows = to_device(plan.rows, torch.long, device)
        targets = to_device(plan.targets, torch.long, device).unsqueeze(1)
        width = max(plan.tops)
        step = max(1, MAX_SLICE_ELEMENTS // self.vocab_size)
        chosen: list[torch.Tensor] = []
        ranks: list[torch.Tensor] = []
        top_values: list[torch.Tensor] = []
        top_ids: list[torch.Tensor] = []
        for begin in range(0, len(plan.rows), step):
            with InvariantLinearMode() if self.batch_invariant else contextlib.nullcontext():
                logits = self.logits(hidden.index_select(0, rows[begin : begin + step]), rows[begin : begin + step])
            if self.batch_invariant:
                logits, normalizer = invariant_log_softmax(logits), torch.zeros((), device=device)
            else:
                normalizer = torch.logsumexp(logits, -1, keepdim=True)
            target_logits = logits.gather(1, targets[begin : begin + step])
            chosen.append((target_logits - normalizer).flatten())
            ranks.append((logits > target_logits).sum(-1) + 1)  # vLLM's rank: 1 + tokens strictly more likely
            if width:
                values, ids = top_entries(logits, width)
                top_values.append((values - normalizer).flatten())
                top_ids.append(ids.flatten())
            del logits, normalizer
        parts = chosen + ranks + top_values + top_ids
        return PendingPromptLogprobs(plan, width, torch.cat([part.double() for part in parts]))

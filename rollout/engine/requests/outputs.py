"""`GenerationOutput`: what one sample produced, shaped so that code written for transformers' continuous batching
reads it unchanged (`status`, `is_finished()`, `created_time`, `lifespan`, `timestamps`), with rollout's own fields
beside them (group, finish reason, top logprobs, policy versions)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from rollout.engine.requests.request import Request, sample_id


class OutputStatus(IntEnum):
    """Where a sample was when an output was made; the values of transformers' `RequestStatus`, so outputs compare
    equal to its members (`output.status == transformers...RequestStatus.FINISHED`)."""

    PENDING = 0  # not started (an output made before the engine took the request)
    PREFILLING = 1
    DECODING = 2  # running: a streaming delta
    FINISHED = 3  # ended: stop, length or abort
    FAILED = 4  # ended with an error


class FinishedFlag(int):
    """A bool that can also be called: `if output.is_finished:` and transformers' `output.is_finished()` both work
    (an int subclass because bool cannot be subclassed; it only ever holds 0 or 1)."""

    def __new__(cls, value: object) -> FinishedFlag:
        return super().__new__(cls, bool(value))

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))

    __str__ = __repr__


@dataclass
class GenerationOutput:
    """What one sample produced (a streaming delta carries only the new tokens since the last delta).

    Constructible as transformers constructs its own: `GenerationOutput(request_id, prompt_ids=..., generated_tokens=
    ..., logprobs=..., error=..., status=..., created_time=..., lifespan=..., timestamps=...)`; rollout's engine also
    sets the fields after those.

    Attributes:
        request_id: the sample's id: the id given to `add_request` when n == 1, else `"<id>#<sample_index>"`.
        prompt_ids: the prompt.
        generated_tokens: generated token ids (only the new ones in a streaming delta).
        logprobs: one fp32 log-prob per generated token (empty when logprobs are off).
        error: a message when finish_reason is "error".
        status: an `OutputStatus` (transformers' `RequestStatus` values).
        created_time: `time.perf_counter()` when the request was added.
        lifespan: (perf_counter when it was first scheduled, when it ended); -1 for what has not happened yet.
        timestamps: perf_counter of each token in `generated_tokens` when it reached the host, if the request was
            added with record_timestamps=True, else None.
        group_id: the id given to `add_request` (defaults to request_id).
        sample_index: index of this sample within its group (0 for n == 1).
        top_logprobs: per generated token, (token id, log-prob) pairs of the most likely tokens, if asked.
        finish_reason: "stop", "length", "abort" or "error"; None while running (streaming deltas).
        is_finished: true on the last output of a sample; also callable, as transformers' `is_finished()`.
        policy_versions: the weights' version that sampled each token in `generated_tokens`, run-length encoded as
            [version, index of the first token it sampled] pairs (indices into `generated_tokens`).
        kv_version_min: the oldest weights' version behind the sample's KV cache when this output was made, or behind
            KV it held before (a preemption, a "recompute" commit) that newer weights sampled tokens over (None when
            it never computed anything; for a sample preempted and not readmitted yet, the KV it last had).
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, log p(prompt[i] | prompt[:i]) for every prompt
            position (None at position 0), fp32 log_softmax of the model's raw logits; set on a sample's first
            output only (its first streaming delta, or its one final output), else None (also when the sample ended
            before its prompt was computed).
        prompt_top_logprobs: alongside prompt_logprobs, per prompt position the `prompt_logprobs` most likely
            (token id, log-prob) pairs, most likely first (None at position 0; empty lists when k is 0).
        prompt_logprob_ranks: alongside prompt_logprobs, each prompt token's rank in its distribution (1: the most
            likely; ties share the better rank, as vLLM; None at position 0).
        adapter: the LoRA adapter that sampled it (None: the base model).
        adapter_version: that adapter's policy version when this output was made (None for the base model).
        routes: with `SamplingParams.return_routes` (an MoE model), int16 (tokens, MoE layers, top_k): row i the
            experts each MoE layer chose in the forward that sampled `generated_tokens[i]` (the input at position
            prompt_len - 1 + i), in the router's own order; None without.
        prompt_routes: alongside routes, int16 (prompt_len - 1, MoE layers, top_k) for the prompt positions before
            the last; set on a sample's first output only (as prompt_logprobs).
        cached_prompt_tokens: prompt tokens whose KV the prefix cache gave the sample when it was first admitted
            (OpenAI's `usage.prompt_tokens_details.cached_tokens`); None before that.
        request_fault: with finish_reason "error", the error is what the request asked for (bans or a grammar that
            left no token to draw), not a failure of the engine.
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: OutputStatus | None = None  # None: derived from is_finished / finish_reason
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1.0, -1.0)
    timestamps: list[float] | None = None
    group_id: str | None = None
    sample_index: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    is_finished: FinishedFlag | bool | None = None  # None: derived from status
    policy_versions: list[list[int]] = field(default_factory=list)
    kv_version_min: int | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    adapter: str | None = None
    adapter_version: int | None = None
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None
    cached_prompt_tokens: int | None = None
    request_fault: bool = False

    def __post_init__(self) -> None:
        if self.group_id is None:
            self.group_id = self.request_id
        if self.status is None:
            if not self.is_finished:
                self.status = OutputStatus.DECODING if self.generated_tokens else OutputStatus.PENDING
            else:
                self.status = OutputStatus.FAILED if self.finish_reason == "error" else OutputStatus.FINISHED
        else:
            self.status = OutputStatus(self.status)
        if self.is_finished is None:
            self.is_finished = self.status >= OutputStatus.FINISHED
        self.is_finished = FinishedFlag(self.is_finished)


def progress_output(request: Request) -> GenerationOutput:
    """What a request that progressed delivers now: a streaming one the tokens since its last delta, a non-streaming
    one its whole output once finished. Marks them delivered."""
    start = request.num_delivered_tokens if request.streaming else 0
    if request.is_finished and request.finished_time < 0:
        request.finished_time = time.perf_counter()
    output = GenerationOutput(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids,
        generated_tokens=request.token_ids[request.num_prompt_tokens + start :],
        logprobs=request.logprobs[start:],
        error=request.error,
        status=_output_status(request),
        created_time=request.created_time,
        lifespan=(request.started_time, request.finished_time),
        timestamps=None if request.token_times is None else request.token_times[start:],
        group_id=request.group_id,
        sample_index=request.sample_index,
        top_logprobs=request.top_logprobs[start:],
        finish_reason=request.finish_reason if request.is_finished else None,
        is_finished=request.is_finished,
        policy_versions=_versions_from(request.token_versions, start, request.num_output_tokens),
        kv_version_min=request.oldest_kv_version,
        cached_prompt_tokens=request.cached_prompt_tokens,
        request_fault=request.request_fault,
    )
    if request.adapter is not None:
        output.adapter, output.adapter_version = request.adapter.name, request.adapter.version
    if request.routes is not None:
        output.routes = request.routes.generated_routes(start, request.num_output_tokens)
        if start == 0:
            output.prompt_routes = request.routes.prompt_routes()
    scored = request.prompt_logprobs
    if start == 0 and scored is not None and len(scored) == request.num_prompt_tokens:  # its first output
        output.prompt_logprobs, output.prompt_top_logprobs = scored, request.prompt_top_logprobs
        output.prompt_logprob_ranks = request.prompt_logprob_ranks
    request.num_delivered_tokens = request.num_output_tokens
    return output


def never_started(request: Request, reason: str, error: str | None) -> list[GenerationOutput]:
    """Final outputs, one per sample, for a group the engine never took (refused late, or its manager stopped)."""
    if request.num_forks == 0:
        sample_ids = [request.request_id]
    else:
        sample_ids = [sample_id(request.group_id, i) for i in range(request.num_forks + 1)]
    return [
        GenerationOutput(
            sid,
            request.prompt_ids,
            error=error,
            created_time=request.created_time,
            group_id=request.group_id,
            sample_index=i,
            finish_reason=reason,
            is_finished=True,
        )
        for i, sid in enumerate(sample_ids)
    ]


def _output_status(request: Request) -> OutputStatus:
    if request.is_finished:
        return OutputStatus.FAILED if request.finish_reason == "error" else OutputStatus.FINISHED
    return OutputStatus.DECODING if request.num_output_tokens else OutputStatus.PREFILLING


def _versions_from(token_versions: list[list[int]], start: int, end: int) -> list[list[int]]:
    """The run-length encoded versions of output tokens [start:end) (end: all tokens so far), re-indexed."""
    if start >= end:
        return []
    runs = [[version, max(0, first - start)] for version, first in token_versions]
    # Keep only the last run that begins at or before `start`, and every later one.
    first_kept = max((i for i, (_, first) in enumerate(token_versions) if first <= start), default=0)
    return runs[first_kept:]

"""One sample being generated: its tokens, its progress through the KV cache and its sampling state.

A GRPO group of n samples is n `Request`s that share a `group_id`; sample 0 (the leader) is admitted first and, when
its prompt is computed, the scheduler forks the other n - 1 from it so they share the prompt's KV blocks.
This module never imports torch: the scheduler and block manager work on these objects alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from rollout.config import SamplingParams
from rollout.detokenizer import OutputText
from rollout.engine.requests.adapter_ref import AdapterRef
from rollout.engine.requests.route_rows import RouteRows


class RequestStatus(IntEnum):
    """Where a request is in its life. Only WAITING/SWAPPED requests are queued; only RUNNING ones hold GPU blocks."""

    WAITING = 0  # queued; holds no blocks (new, or preempted for recompute)
    RUNNING = 1  # scheduled; holds KV blocks on the device
    SWAPPED = 2  # preempted; its KV lives in CPU swap blocks
    FINISHED = 3  # done; holds nothing


FINISH_REASONS = ("stop", "length", "abort", "error")
# Stands for a token sampled on the device and not yet copied to the host (never a real token id, which is >= 0).
PLACEHOLDER_TOKEN = -1


def sample_id(group_id: str, index: int) -> str:
    """Request id of sample `index` of a group of several samples (a group of one keeps its group id)."""
    return f"{group_id}#{index}"


@dataclass(eq=False, slots=True)
class Request:
    """A single sample. `num_computed_tokens` catches up with `num_tokens`; the gap is what the scheduler schedules."""

    request_id: str
    group_id: str
    sample_index: int
    # Prompt followed by generated tokens; grows by one per sampled token.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    # Per-request base seed; the sampler derives per-token randomness from (seed, sample_index, position).
    seed: int
    # Arrival order; preemption picks the newest (largest) first.
    arrival: int
    # Samples still to fork from this request once its prompt is computed (n - 1 for a group leader, else 0).
    num_forks: int = 0
    # Its place among the waiting requests of all clients (`rollout.engine.scheduling.client_turns`).
    turn: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Bumped by the block manager whenever block_ids changes, so the model runner can cache its tensor form.
    blocks_version: int = 0
    # How many of block_ids it holds alone (ref count 1): the blocks its end gives back (kept by the block manager).
    num_own_blocks: int = 0
    # CPU swap blocks holding this request's KV while SWAPPED.
    swap_block_ids: list[int] = field(default_factory=list)
    # Chained hash of each of this request's full, computed blocks, in order (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    # (policy version, chained hashes of full token blocks): memo for prefix matching while waiting.
    prefix_hash_memo: tuple[int, list[int]] | None = None
    # Policy versions that sampled the output tokens, run-length encoded: [version, first output index] pairs.
    token_versions: list[list[int]] = field(default_factory=list)
    # Oldest policy version behind the KV the request holds now (None while it holds none). Versions only grow,
    # so it is the version of the step that computed the first token of that KV.
    kv_version_min: int | None = None
    # Oldest policy version behind KV it no longer holds (freed by a preemption or a "recompute" commit, then
    # computed anew) that tokens were sampled over by newer weights (after a "keep" commit): None if none. The
    # outputs report the older of it and kv_version_min (`oldest_kv_version`).
    earlier_kv_version: int | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With sampling.prompt_logprobs: log p(prompt[i] | prompt[:i]) per prompt position scored so far (None at 0), and
    # the top-k pairs per position (None at 0), appended as prefill chunks resolve (prompt_logprobs.py); shared, not
    # copied, by forked samples. None without prompt_logprobs.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1: the top)
    # max_new_tokens 0 (with prompt_logprobs): the one token drawn after the prompt is dropped when it resolves, and
    # the sample ends with finish_reason "length" and no tokens (max_new_tokens is 1 for the scheduler).
    score_only: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # The error is the request's own doing (what it asked for cannot be followed: bans or a grammar that leave no
    # token to draw), not a failure of the engine: an HTTP answer is then a 4xx.
    request_fault: bool = False
    # Row of the model runner's persistent block tables that holds this request's block ids (-1: none yet, and once
    # it finished).
    block_table_row: int = -1
    # Row of the sampler's slot tables that holds this sample's sampling parameters (-1: none, before its first draw
    # and once it finished).
    sampling_slot: int = -1
    # The output's text, decoded as tokens resolve, when the request has stop strings (else None).
    stop_text: OutputText | None = None
    # The sample's structured-output grammar state (`rollout.engine.grammar.constraints.Constrained`), or None.
    constraint: Any = None
    # Emit a delta per token (else one output when finished).
    streaming: bool = False
    # How many output tokens were already handed to the caller (streaming deltas).
    num_delivered_tokens: int = 0
    # time.perf_counter() when added, first scheduled, ended (-1: not yet); per output token when it reached the host
    # (None unless the request records timestamps).
    created_time: float = -1.0
    started_time: float = -1.0
    finished_time: float = -1.0
    token_times: list[float] | None = None
    # The LoRA adapter that serves this sample (None: the base model); part of its prefix hashes.
    adapter: AdapterRef | None = None
    # Prompt tokens whose KV came from the prefix cache at the first admission (None until admitted; forks: the
    # leader's, whose prompt KV they share).
    cached_prompt_tokens: int | None = None
    # With sampling.return_routes: the MoE routes of every position computed (route_rows.py); else None.
    routes: RouteRows | None = None
    # Who sent it (`GroupSpec.client`): admission takes turns between clients, and samples share drafts only within
    # one client, one session (`GroupSpec.session`) and one adapter.
    client: str = ""
    session: str = ""
    # Its share of the express lane's blocks while it runs (`rollout.engine.scheduling.express_lane`); 0: admitted
    # otherwise.
    express_blocks: int = 0
    # The drafter's state of this sample (`rollout.engine.speculative.drafter`), None until it drafts.
    draft_row: Any = None
    _prompt_ids: list[int] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt. One list per request, shared by all its outputs (copied once, not per streamed token)."""
        if self._prompt_ids is None:
            self._prompt_ids = self.token_ids[: self.num_prompt_tokens]
        return self._prompt_ids

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt position still lacks its log-prob: such a request takes no cached prefix (its
        tokens must run through the model)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request ended (any finish reason)."""
        return self.status == RequestStatus.FINISHED

    @property
    def reached_max_tokens(self) -> bool:
        """True once its last token, possibly not resolved yet, is its max_new_tokens-th: it computes nothing more."""
        return self.num_output_tokens >= self.max_new_tokens

    @property
    def has_placeholder(self) -> bool:
        """True between `add_placeholder` and `resolve_token`: the last token was sampled but is still on the
        device."""
        return bool(self.token_ids) and self.token_ids[-1] == PLACEHOLDER_TOKEN

    def add_placeholder(self, policy_version: int) -> None:
        """Count a token sampled on the device whose value is not on the host yet (overlapped scheduling).

        Args:
            policy_version: the version of the weights that sampled it.
        """
        token_ids, versions = self.token_ids, self.token_versions
        token_ids.append(PLACEHOLDER_TOKEN)
        if not versions or versions[-1][0] != policy_version:
            versions.append([policy_version, len(token_ids) - 1 - self.num_prompt_tokens])

    def resolve_token(self, token_id: int, logprob: float | None = None) -> None:
        """Replace the placeholder by the sampled token and set `finish_reason` when it stops the request (stop
        token, stop string or length). Runs for every sample at every step: properties inlined.

        Args:
            token_id: the sampled token.
            logprob: its log-prob, appended to `logprobs` (None: log-probs are not computed).
        """
        token_ids = self.token_ids
        if not token_ids or token_ids[-1] != PLACEHOLDER_TOKEN:
            raise RuntimeError(f"request {self.request_id} has no sampled token to resolve")
        if self.score_only:  # max_new_tokens 0: nothing drawn is kept
            self.drop_placeholder()
            self.top_logprobs.clear()
            self.finish_reason = "length"
            return
        token_ids[-1] = token_id
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.token_times is not None:
            self.token_times.append(time.perf_counter())
        num_output_tokens = len(token_ids) - self.num_prompt_tokens
        stop_text = self.stop_text
        if stop_text is not None:
            try:
                stop_text.add(token_id)
            except Exception as error:  # noqa: BLE001 - the caller's tokenizer failed: this sample, not the engine
                self.finish_reason = "error"
                self.error = f"stop: the tokenizer failed to decode the output (token {token_id}): {error!r}"
                return
        constraint = self.constraint
        if constraint is not None:
            constraint.accept(token_id)
            if constraint.rejected is not None:
                self.finish_reason = "error"
                self.error = f"{constraint.field}: the grammar does not allow token {token_id} here"
                return
            if constraint.terminated:
                self.finish_reason = "stop"
                return
        # A stop token counts once min_new_tokens tokens came before it (the sampler masks it until then); so does a
        # stop string (OutputText looks for one only past min_new_tokens).
        if token_id in self.stop_token_ids and num_output_tokens > self.sampling.min_new_tokens:
            self.finish_reason = "stop"
        elif stop_text is not None and stop_text.stopped is not None:
            self.finish_reason = "stop"
        elif num_output_tokens >= self.max_new_tokens:
            self.finish_reason = "length"

    @property
    def oldest_kv_version(self) -> int | None:
        """What its outputs report as `kv_version_min`: the oldest policy version behind the KV it holds, or behind
        KV it held that newer weights sampled tokens over (None before any KV). With the first token's version, the
        oldest weights behind any of its tokens (`sample_oldest_version`)."""
        versions = [v for v in (self.kv_version_min, self.earlier_kv_version) if v is not None]
        return min(versions) if versions else None

    def admitted(self, prefix_version: int | None) -> None:
        """Taken into the running set (again): the KV it held is gone, and the KV it holds now is the cached prefix
        it takes. If newer weights sampled tokens over the KV it held (its last token is the newest), that KV's
        version stays on record (`earlier_kv_version`): a token sampled by its KV's own weights needs none, its
        version says as much.

        Args:
            prefix_version: the policy version of the cached prefix blocks it takes (a lookup matches only blocks of
                the version current then), or None when it takes none: its KV is then computed anew, and its first
                step sets the version.
        """
        held = self.kv_version_min
        if held is not None and self.token_versions and self.token_versions[-1][0] > held:
            self.earlier_kv_version = self.oldest_kv_version
        self.kv_version_min = prefix_version

    def drop_placeholder(self) -> None:
        """Forget an unresolved token (its step failed): the request is as before `add_placeholder`."""
        if self.has_placeholder:
            self.token_ids.pop()
            if self.token_versions[-1][1] >= self.num_output_tokens:  # a run that began with the dropped token
                self.token_versions.pop()

    def fork(self, sample_index: int, request_id: str, arrival: int) -> Request:
        """A new sample of the same group with the same tokens so far; blocks are shared by the block manager."""
        forked = Request(
            request_id=request_id,
            group_id=self.group_id,
            sample_index=sample_index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            arrival=arrival,
            stop_text=None if self.stop_text is None else self.stop_text.restarted(),
            constraint=None if self.constraint is None else self.constraint.restarted(),
            streaming=self.streaming,
            created_time=self.created_time,
            started_time=self.started_time,
            token_times=None if self.token_times is None else list(self.token_times),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            block_hashes=list(self.block_hashes),
            token_versions=[list(pair) for pair in self.token_versions],
            kv_version_min=self.kv_version_min,
            earlier_kv_version=self.earlier_kv_version,
            prompt_logprobs=self.prompt_logprobs,  # shared: the prompt is scored once per group
            prompt_top_logprobs=self.prompt_top_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks,
            score_only=self.score_only,
            adapter=self.adapter,
            cached_prompt_tokens=self.cached_prompt_tokens,
            client=self.client,
            session=self.session,
            turn=self.turn,
        )
        if self.routes is not None:  # the prompt's routes are shared, as its KV is
            forked.routes = self.routes.forked(forked)
        return forked

"""A group in flight on a worker, as its client sees it: the engine's outputs of its samples are folded into
protocol messages (a `Delta` per new tokens of a streaming sample, one `GroupResult` once every sample finished).
Engine thread only, after the serving thread registered the group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout import protocol as p
from rollout.protocol import reply_frames

if TYPE_CHECKING:  # (the protocol imports nothing from the engine: outputs are read by their fields)
    from rollout.engine.requests.outputs import GenerationOutput


@dataclass
class GroupInFlight:
    """One accepted generate request."""

    identity: bytes  # the client's ZeroMQ identity
    group_id: str  # as the client named it
    prompt_ids: list[int]
    n: int
    stream: bool
    key: str | None = None  # the client's CurveZMQ public key (z85), when the worker checks keys
    span: Any = None  # its OpenTelemetry span (tracing.py), or None
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[list[int]]] = field(default_factory=dict)
    completions: list[p.Completion] = field(default_factory=list)
    started_sampling: bool = False
    routes: dict[int, list[np.ndarray]] = field(default_factory=dict)  # per sample, with return_routes
    prompt_routes: dict[int, np.ndarray] = field(default_factory=dict)
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)  # running samples' rows
    # A finished sample's rows as (ids, log-probs) arrays (None: none, or a piece was lost): each made as its sample
    # ends, so that the last one does not make a whole group's at once on the engine thread.
    top_arrays: dict[int, tuple[np.ndarray, np.ndarray] | None] = field(default_factory=dict)
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # with prompt_logprobs, per sample
    # The samples of a group share their prompt's lists (the engine scores the prompt once): one PromptScores each.
    shared_prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # by id() of its logprobs list
    cancel_requested: bool = False  # its client cancelled it (or was lost): a group still compiling is never run

    @property
    def client(self) -> str:
        """Who sent the group, as turns, limits and drafts count clients: its key when the worker checks keys (one
        trainer's many connections are one client), else its connection."""
        return f"key:{self.key}" if self.key is not None else self.identity.hex()

    @property
    def engine_id(self) -> str:
        """The id the engine knows the group by: per client, so two clients may both send group "0"."""
        return engine_id(self.identity, self.group_id)

    def absorb(self, output: GenerationOutput, policy_version: int) -> tuple[p.Delta | None, p.GroupResult | None]:
        """Fold one engine output of a sample in.

        Args:
            output: the sample's output (streaming: the new tokens only; otherwise everything so far).
            policy_version: the version being served (for a sample that reports none).
        Returns:
            (the delta to stream, or None; the group's result once its last sample finished, or None).
        """
        index = output.sample_index
        tokens = self.token_ids.setdefault(index, [])
        logprobs = self.logprobs.setdefault(index, [])
        tops = self.top_logprobs.setdefault(index, [])
        delta = None
        if output.prompt_routes is not None:
            self.prompt_routes[index] = output.prompt_routes
        prompt_scores = self._prompt_scores_of(output)
        if self.stream:
            tokens.extend(output.generated_tokens)
            logprobs.extend(output.logprobs)
            tops.extend(output.top_logprobs)
            if output.routes is not None:
                self.routes.setdefault(index, []).append(output.routes)
            if output.generated_tokens:
                version = output.policy_versions[-1][0] if output.policy_versions else policy_version
                delta = p.Delta(self.group_id, index, output.generated_tokens, output.logprobs, version)
                delta.data_frames = []
                delta.routes = reply_frames.pack_routes(output.routes, delta.data_frames)
                delta.prompt_routes = reply_frames.pack_routes(output.prompt_routes, delta.data_frames)
                if len(output.top_logprobs) == len(output.generated_tokens):
                    delta.top_token_ids, delta.top_logprobs = reply_frames.pack_top(
                        output.top_logprobs, delta.data_frames
                    )
                if prompt_scores is not None:
                    prompt_scores.put(delta, delta.data_frames)
            extend_version_runs(
                self.versions.setdefault(index, []), output.policy_versions, len(tokens) - len(output.generated_tokens)
            )
        else:
            tokens[:], logprobs[:], tops[:] = output.generated_tokens, output.logprobs, output.top_logprobs
            self.versions[index] = output.policy_versions
            if output.routes is not None:
                self.routes[index] = [output.routes]
        if not output.is_finished:
            return delta, None
        tops = self.top_logprobs.pop(index, [])  # a piece was lost (a failed step): none, not shifted
        self.top_arrays[index] = reply_frames.top_arrays(tops) if len(tops) == len(tokens) else None
        kv_version_min = output.kv_version_min if output.kv_version_min is not None else policy_version
        completion = p.Completion(
            index,
            tokens,
            logprobs,
            output.finish_reason,
            output.error,
            self.versions.get(index, []),
            kv_version_min,
            output.adapter,
            output.adapter_version,
            cached_prompt_tokens=output.cached_prompt_tokens or 0,
        )
        self.completions.append(completion)
        if len(self.completions) < self.n:
            return delta, None
        completions = sorted(self.completions, key=lambda c: c.sample_index)
        result = p.GroupResult(self.group_id, self.prompt_ids, completions)
        result.data_frames = []
        prompt_entries: dict[int, tuple] = {}  # the frames of each prompt's scores, named by every completion
        for completion in completions:
            pieces = self.routes.get(completion.sample_index)
            routes = np.concatenate(pieces) if pieces else None
            if routes is not None and len(routes) != len(completion.token_ids):  # a piece was lost: none, not shifted
                routes = None
            completion.routes = reply_frames.pack_routes(routes, result.data_frames)
            completion.prompt_routes = reply_frames.pack_routes(
                self.prompt_routes.get(completion.sample_index), result.data_frames
            )
            completion.top_token_ids, completion.top_logprobs = reply_frames.pack_top_arrays(
                self.top_arrays.get(completion.sample_index), result.data_frames
            )
            prompt_scores = self.prompt_scores.get(completion.sample_index)
            if prompt_scores is not None:
                prompt_scores.put(completion, result.data_frames, prompt_entries)
        return delta, result

    def _prompt_scores_of(self, output: GenerationOutput) -> PromptScores | None:
        """The output's prompt log-probs (a sample's first output only), one PromptScores per distinct prompt lists."""
        if output.prompt_logprobs is None:
            return None
        scores = self.shared_prompt_scores.get(id(output.prompt_logprobs))  # (the list lives on in `scores`)
        if scores is None or scores.source is not output.prompt_logprobs:
            scores = PromptScores.of(output)
            self.shared_prompt_scores[id(output.prompt_logprobs)] = scores
        self.prompt_scores[output.sample_index] = scores
        return scores


@dataclass
class PromptScores:
    """A prompt's log-probs (`SamplingParams.prompt_logprobs`) as arrays, made once from a sample's first output,
    however many samples (and their messages) carry them: row i is prompt position i + 1."""

    source: list[float | None]  # the engine's list they were made from (the samples of a group share it)
    logprobs: np.ndarray  # (prompt_len - 1,) float32
    ranks: np.ndarray  # (prompt_len - 1,) int32
    top: tuple[np.ndarray, np.ndarray] | None  # (ids, log-probs), each (prompt_len - 1, k); None: k = 0

    @classmethod
    def of(cls, output: GenerationOutput) -> PromptScores:
        """The arrays of an output that carries prompt log-probs (a sample's first)."""
        scored = output.prompt_logprobs
        top = output.prompt_top_logprobs
        return cls(
            scored,
            np.array(scored[1:], dtype=np.float32),
            np.array(output.prompt_logprob_ranks[1:], dtype=np.int32),
            None if top is None else reply_frames.top_arrays(top[1:]),
        )

    def put(self, message: p.SampleArrays, frames: list[bytes], entries: dict[int, tuple] | None = None) -> None:
        """Set them on a completion or delta as frames.

        Args:
            message: the completion or delta.
            frames: its message's data frames (appended to).
            entries: the frame entries already in `frames`, by id() of their PromptScores (updated): the
                completions of one group_result name the same frames.
        """
        packed = None if entries is None else entries.get(id(self))
        if packed is None:
            packed = (
                reply_frames.pack_array(self.logprobs, "float32", frames),
                reply_frames.pack_array(self.ranks, "int32", frames),
                *reply_frames.pack_top_arrays(self.top, frames),
            )
            if entries is not None:
                entries[id(self)] = packed
        message.prompt_logprobs, message.prompt_logprob_ranks = packed[:2]
        message.prompt_top_token_ids, message.prompt_top_logprobs = packed[2:]


def engine_id(identity: bytes, group_id: str) -> str:
    """The engine's id of a client's group."""
    return f"{identity.hex()}/{group_id}"


def extend_version_runs(runs: list[list[int]], new_runs: list[list[int]], first_index: int) -> None:
    """Append a delta's run-length encoded versions (indices relative to the delta) to a sample's runs.

    Args:
        runs: the sample's [version, first token index] runs so far (extended in place).
        new_runs: the delta's runs, indices relative to the delta.
        first_index: index in the sample of the delta's first token.
    """
    for version, first in new_runs:
        if not runs or runs[-1][0] != version:
            runs.append([version, first_index + first])

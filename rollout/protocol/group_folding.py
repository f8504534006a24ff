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
    span: Any = None  # its OpenTelemetry span (tracing.py), or None
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[list[int]]] = field(default_factory=dict)
    completions: list[p.Completion] = field(default_factory=list)
    started_sampling: bool = False
    routes: dict[int, list[np.ndarray]] = field(default_factory=dict)  # per sample, with return_routes
    prompt_routes: dict[int, np.ndarray] = field(default_factory=dict)
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)  # with top_logprobs
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # with prompt_logprobs
    cancel_requested: bool = False  # its client cancelled it (or was lost): a group still compiling is never run

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
        prompt_scores = PromptScores.of(output)
        if prompt_scores is not None:
            self.prompt_scores[index] = prompt_scores
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
        for completion in completions:
            pieces = self.routes.get(completion.sample_index)
            routes = np.concatenate(pieces) if pieces else None
            if routes is not None and len(routes) != len(completion.token_ids):  # a piece was lost: none, not shifted
                routes = None
            completion.routes = reply_frames.pack_routes(routes, result.data_frames)
            completion.prompt_routes = reply_frames.pack_routes(
                self.prompt_routes.get(completion.sample_index), result.data_frames
            )
            tops = self.top_logprobs.get(completion.sample_index, [])
            if len(tops) == len(completion.token_ids):  # a piece was lost (a failed step): none, not shifted
                completion.top_token_ids, completion.top_logprobs = reply_frames.pack_top(tops, result.data_frames)
            prompt_scores = self.prompt_scores.get(completion.sample_index)
            if prompt_scores is not None:
                prompt_scores.put(completion, result.data_frames)
        return delta, result


@dataclass
class PromptScores:
    """A sample's prompt log-probs (`SamplingParams.prompt_logprobs`), as its first output brought them."""

    logprobs: list[float | None]
    ranks: list[int | None] | None
    top: list[list[tuple[int, float]] | None] | None

    @classmethod
    def of(cls, output: GenerationOutput) -> PromptScores | None:
        """The output's prompt log-probs, if it carries them (a sample's first output only)."""
        if output.prompt_logprobs is None:
            return None
        return cls(output.prompt_logprobs, output.prompt_logprob_ranks, output.prompt_top_logprobs)

    def put(self, message: p.Completion | p.Delta, frames: list[bytes]) -> None:
        """Set them on a completion or delta, the top pairs of positions 1.. as two frames."""
        message.prompt_logprobs, message.prompt_logprob_ranks = self.logprobs, self.ranks
        if self.top is not None:
            message.prompt_top_token_ids, message.prompt_top_logprobs = reply_frames.pack_top(self.top[1:], frames)


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

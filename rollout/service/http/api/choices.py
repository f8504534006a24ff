"""One choice of an HTTP answer (one sample): the engine's streamed outputs folded into its tokens, log-probs,
policy versions and text, and the OpenAI shapes of what it returns (a whole choice, or a streamed chunk's)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout.detokenizer import OutputText, TokenBytes
from rollout.engine.requests.outputs import GenerationOutput
from rollout.protocol.group_folding import extend_version_runs


@dataclass
class ChoiceDelta:
    """What one engine output added to a choice."""

    text: str
    start: int  # index in the choice of the first new token
    end: int  # one past the last new token
    finished: bool


@dataclass
class Choice:
    """One sample of a request, as the HTTP answer reports it.

    Attributes:
        index: the choice's index in the answer (prompt index * n + sample index).
        prompt_ids: its prompt.
        text: the completion's text (cut at a stop string; `rollout.detokenizer`; without the text of a stop token
            that ended it).
    """

    index: int
    prompt_ids: list[int]
    text: OutputText
    # Stop tokens whose text is left out of `text` when they end the choice (unless include_stop_str_in_output).
    silent_stops: frozenset[int] = frozenset()
    # The stop tokens the request named (`stop_token_ids`): the one that ended the choice is its stop_reason; the
    # model's own EOS is not (None, as vLLM).
    named_stops: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    policy_versions: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    request_fault: bool = False  # the error is what the request asked for (`GenerationOutput.request_fault`)
    failed_here: bool = False  # ended by the front end: the tokenizer failed to decode its output (`absorb`)
    kv_version_min: int | None = None
    # With prompt log-probs (echo, prompt_logprobs): per prompt position (None at 0) the prompt token's log-prob, the
    # top pairs and its rank, from the sample's first output.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # With return_routed_experts (an MoE model): the routes of each output's tokens, and of the prompt.
    cached_prompt_tokens: int = 0  # of its prompt, from the prefix cache (usage.prompt_tokens_details)
    routes: list[np.ndarray] = field(default_factory=list)
    routes_rows: int = 0
    prompt_routes: np.ndarray | None = None
    # (token index, text length of the tokens before it): where the last streamed chunk's text offsets ended, so
    # that a long stream's offsets are not summed from its first token at every chunk.
    offset_mark: tuple[int, int] = (0, 0)
    # The text length of its prompt's tokens, each on its own (where an echoed completion's text offsets start).
    prompt_chars: int | None = None

    def absorb(self, output: GenerationOutput) -> ChoiceDelta:
        """Fold in one streamed output of this sample (its new tokens only). A tokenizer that fails to decode them
        ends the choice here, with an error naming it (`failed_here`; its later outputs change nothing)."""
        if self.failed_here:
            return ChoiceDelta("", len(self.token_ids), len(self.token_ids), False)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = output.prompt_logprobs, output.prompt_top_logprobs
            self.prompt_ranks = output.prompt_logprob_ranks
        if output.cached_prompt_tokens is not None:
            self.cached_prompt_tokens = output.cached_prompt_tokens
        if output.prompt_routes is not None:
            self.prompt_routes = output.prompt_routes
        if output.routes is not None:
            self.routes.append(output.routes)
            self.routes_rows += len(output.routes)
        start = len(self.token_ids)
        self.token_ids += output.generated_tokens
        self.logprobs += output.logprobs
        self.top_logprobs += output.top_logprobs
        extend_version_runs(self.policy_versions, output.policy_versions, start)
        tokens = output.generated_tokens
        if output.is_finished and output.finish_reason == "stop" and tokens and tokens[-1] in self.silent_stops:
            tokens = tokens[:-1]  # a stop token's text is not returned (vLLM), though the token is
        try:
            text = "".join([self.text.add(token) for token in tokens])
            if output.is_finished:
                text += self.text.finish()
        except Exception as error:  # noqa: BLE001 - the served tokenizer failed on this output: this choice fails
            self.failed_here = True
            self.finish_reason, self.request_fault = "error", False
            self.error = f"the tokenizer failed to decode the output (tokens {tokens[:8]}): {error!r}"[:500]
            return ChoiceDelta("", start, len(self.token_ids), True)
        if output.is_finished:
            self.finish_reason, self.error = output.finish_reason, output.error
            self.request_fault = output.request_fault
            self.kv_version_min = output.kv_version_min
        return ChoiceDelta(text, start, len(self.token_ids), bool(output.is_finished))

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the choice, else the requested stop token that did, else
        None (the model's EOS, the length limit)."""
        if self.text.stopped is not None:
            return self.text.stopped
        if self.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in self.named_stops:
            return self.token_ids[-1]
        return None

    def rollout_fields(self, start: int = 0, end: int | None = None) -> dict[str, Any]:
        """rollout's extra fields: the policy versions of tokens [start, end) (run-length encoded, re-indexed), and
        the oldest version behind the sample's KV once finished."""
        end = len(self.token_ids) if end is None else end
        runs = [[v, max(0, first - start)] for v, first in self.policy_versions if first < end]
        first_kept = max((i for i, (_, first) in enumerate(self.policy_versions) if first <= start), default=0)
        extra: dict[str, Any] = {"policy_versions": runs[first_kept:] if start < end else []}
        if self.finish_reason is not None:
            extra["kv_version_min"] = self.kv_version_min
        if self.routes or self.prompt_routes is not None:
            extra["routed_experts"] = encoded_routes(self._routes_between(start, end))
            if start == 0:
                extra["prompt_routed_experts"] = encoded_routes(self.prompt_routes)
        return extra

    def _routes_between(self, start: int, end: int) -> np.ndarray | None:
        """Routes of tokens [start, end) (None when some output carried none: never shifted); a stream's chunk is its
        last output's (no copy of the whole)."""
        pieces = self.routes
        if self.routes_rows != len(self.token_ids):
            return None
        if pieces and end == len(self.token_ids) and end - start == len(pieces[-1]):
            return pieces[-1]
        if not pieces:  # no token yet: an empty array of the prompt's (layers, top_k), as tokens would have
            known = self.prompt_routes is not None and self.prompt_routes.ndim == 3
            return np.zeros((0, *(self.prompt_routes.shape[1:] if known else (0, 0))), dtype=np.int16)
        return np.concatenate(pieces)[start:end]


def encoded_routes(routes: np.ndarray | None) -> str | None:
    """MoE routes as the HTTP API returns them: a base64 .npy file of int16 (tokens, MoE layers, top_k), which
    `numpy.load(io.BytesIO(base64.b64decode(text)))` reads back with its shape."""
    if routes is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routes, dtype=np.int16), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# What a log-prob of -inf is sent as (a token the processors or a grammar ruled out, among the top log-probs): JSON has
# no infinity. vLLM's value.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """A log-prob as JSON can carry it: -inf (and anything below) becomes LOGPROB_FLOOR."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class LogprobFormat:
    """Token strings and the two OpenAI log-prob shapes (completions' and chat's) for one tokenizer; every log-prob
    finite (`finite`)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes = TokenBytes(tokenizer)  # chat's `bytes`: a token's own, where it splits a character too
        self._bytes_cache: dict[int, list[int]] = {}

    def token(self, token_id: int) -> str:
        """The text of one token on its own."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text

    def completion(self, choice: Choice, start: int, end: int, top: int, offset: int) -> dict[str, Any]:
        """Completions' `logprobs` object for tokens [start, end) (`offset`: their text's start in the choice); each
        position's `top_logprobs` holds the `top` most likely tokens and the sampled one (k+1 entries when it is not
        among them, as vLLM)."""
        return self._completion_rows(
            choice.token_ids[start:end], choice.logprobs[start:end], choice.top_logprobs[start:end], top, offset
        )

    def text_offset(self, choice: Choice, start: int) -> int:
        """The length of the text of the choice's tokens before token `start` (each token's own text)."""
        index, chars = choice.offset_mark if choice.offset_mark[0] <= start else (0, 0)
        chars += sum(len(self.token(t)) for t in choice.token_ids[index:start])
        choice.offset_mark = (start, chars)
        return chars

    def prompt_length(self, choice: Choice) -> int:
        """The text length of the choice's prompt tokens, each token's own text (as `echoed_prompt` offsets them)."""
        if choice.prompt_chars is None:
            choice.prompt_chars = sum(len(self.token(t)) for t in choice.prompt_ids)
        return choice.prompt_chars

    def echoed_prompt(self, choice: Choice, top: int) -> dict[str, Any]:
        """Completions' `logprobs` object for the prompt of an `echo` answer: the first token has no log-prob (None,
        as its top_logprobs), the others their log-probs given the tokens before them (as vLLM and lm-eval read)."""
        prompt = choice.prompt_ids
        rows = self._completion_rows(prompt[1:], choice.prompt_logprobs[1:], choice.prompt_top_logprobs[1:], top, 0)
        first = self.token(prompt[0])
        return {
            "tokens": [first, *rows["tokens"]],
            "token_logprobs": [None, *rows["token_logprobs"]],
            "top_logprobs": None if rows["top_logprobs"] is None else [None, *rows["top_logprobs"]],
            "text_offset": [0, *(offset + len(first) for offset in rows["text_offset"])],
        }

    def prompt_logprobs(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per token a map of token id to
        {logprob, rank, decoded_token} holding the prompt token and the top k (None: the prompt was not scored)."""
        if choice.prompt_logprobs is None:
            return None
        entries: list[dict[str, dict[str, Any]] | None] = [None]
        for position in range(1, len(choice.prompt_ids)):
            token = choice.prompt_ids[position]
            entry = {
                str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": self.token(t)}
                for rank, (t, lp) in enumerate(choice.prompt_top_logprobs[position], 1)
            }
            entry.setdefault(
                str(token),
                {
                    "logprob": finite(choice.prompt_logprobs[position]),
                    "rank": choice.prompt_ranks[position],
                    "decoded_token": self.token(token),
                },
            )
            entries.append(entry)
        return entries

    def _completion_rows(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top_rows: list[list[tuple[int, float]]],
        top: int,
        offset: int,
    ) -> dict[str, Any]:
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top_maps = None
        if top is not None:
            # As vLLM: the sampled (or prompt) token joins the top `top` when it is not among them (k+1 entries; with
            # `logprobs: 0`, the token alone).
            top_maps = []
            for index, (token, logprob) in enumerate(zip(tokens, logprobs)):
                row = top_rows[index][:top] if top and index < len(top_rows) else ()  # k = 0 computes no rows
                entries = {self.token(t): finite(lp) for t, lp in row}
                entries.setdefault(token, finite(logprob))
                top_maps.append(entries)
        token_logprobs = [finite(logprob) for logprob in logprobs]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_maps, "text_offset": offsets}

    def chat(self, choice: Choice, start: int, end: int, top: int) -> dict[str, Any]:
        """Chat's `logprobs` object for tokens [start, end)."""
        content = []
        for position in range(start, end):
            entry = self._entry(choice.token_ids[position], choice.logprobs[position])
            rows = choice.top_logprobs[position][:top] if top else []
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in rows]
            content.append(entry)
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            raw = self._bytes_cache[token_id] = self._bytes(token_id, text)
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

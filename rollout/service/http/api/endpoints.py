"""/v1/completions and /v1/chat/completions: a request body in, an OpenAI answer (or a stream of server-sent
events) out, every choice carrying rollout's `policy_versions` and `kv_version_min` (and, with `return_token_ids`,
vLLM's `prompt_token_ids` and `token_ids`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.group_counters import GroupCounters
from rollout.service.http.api import openai_fields as fields
from rollout.service.http.api.answer_size import check_answer_size
from rollout.service.http.api.bridge import MAX_UNREAD_OUTPUTS_PER_SAMPLE, Submission
from rollout.service.http.api.choices import Choice, ChoiceDelta, LogprobFormat
from rollout.service.http.api.constraint_wait import client_address, compile_constraint
from rollout.service.http.api.prompt_scoring import PromptScoring, echoed_logprobs
from rollout.service.http.api.prompts import PromptLimits, chat_prompt, completion_prompts, needs_tokenizer, tool_spec
from rollout.service.http.api.served_models import requested_adapter
from rollout.service.http.api.structured_fields import structured_request
from rollout.service.http.errors import APIError, bad_field, json_bytes
from rollout.service.http.tools.chat_tools import ToolCalling, tool_calling

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)


@dataclass
class Answer:
    """How one request is answered: its kind, its settings, its submission."""

    chat: bool
    request: fields.GenerationRequest
    submission: Submission
    id: str
    created: int
    tools: ToolCalling | None = None  # chat with tools: how tool calls are read out of the text
    model: str = ""  # what the answer says served it: the worker's model, or the LoRA adapter the request named
    constraint_param: str | None = None  # the field a structured-output constraint came in (None: none)

    @property
    def object(self) -> str:
        """The answer's OpenAI object type."""
        return "chat.completion" if self.chat else "text_completion"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Add the request's groups to the engine (on a worker thread); their outputs come back on `loop`."""
        self.submission.start("messages" if self.chat else "prompt", loop)


class OpenAIEndpoints:
    """The two generation endpoints over one engine manager."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        model_name: str,
        tokenizer: Any,
        max_n: int,
        max_prompt_len: int,
        max_answer_logprobs: int,
        trust_request_chat_template: bool = False,
        counters: GroupCounters | None = None,
        tool_call_parser: str | None = None,
        compiles: ConstraintCompiles | None = None,
    ):
        """
        Args:
            manager: the worker's engine manager (shared with the ZeroMQ socket).
            model_name: the served model's name (`model` must be it, or absent).
            tokenizer: the worker's tokenizer (None: these endpoints answer 400).
            max_n: most samples per request (the worker's --max-n): `n` times the number of prompts.
            max_prompt_len: longest prompt in tokens.
            trust_request_chat_template: accept a chat template in a request's `chat_template_kwargs` (a template
                is code that runs on the worker: off unless the operator trusts every client).
            counters: the worker's group counters (None: a fresh set).
            tool_call_parser: how chat answers' tool calls are read (`tool_calls.TOOL_CALL_PARSERS`; None: chat
                requests that ask for tool calls are refused).
            max_answer_logprobs: most log-prob entries a whole answer may hold (`answer_size.check_answer_size`).
            compiles: the worker's compile slots, shared with its ZeroMQ socket (None: slots of these endpoints' own,
                closed by `close`).
        """
        self.manager = manager
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.max_prompt_len = min(max_prompt_len, manager.engine.max_model_len - 1)
        self.limits = PromptLimits(self.max_prompt_len, trust_request_chat_template)
        self.format = LogprobFormat(tokenizer) if tokenizer is not None else None
        self.counters = GroupCounters() if counters is None else counters
        self.tool_call_parser = tool_call_parser
        self.max_answer_logprobs = max_answer_logprobs
        self._own_compiles = compiles is None
        self.compiles = ConstraintCompiles(manager.engine.intake) if compiles is None else compiles

    # ---- requests -------------------------------------------------------------------------------------------------
    def prepare(self, body: Any, chat: bool) -> Answer:
        """Check a body and tokenize its prompts (slow work: call it off the event loop); `Answer.start` then adds
        its groups to the engine.

        Raises:
            APIError: anything wrong with it, naming the field.
        """
        body = fields.check_fields(body, fields.CHAT_FIELDS if chat else fields.COMPLETION_FIELDS)
        needs_tokenizer(self.tokenizer, "/v1/chat/completions" if chat else "/v1/completions")
        model = body.get("model")
        adapter = requested_adapter(model, self.model_name, self.manager.engine.runner.adapters.refs)
        prompt_field = "messages" if chat else "prompt"
        n = fields.integer(body, "n", 1, 1, self.max_n)
        tools = tool_calling(tool_spec(body), self.tool_call_parser) if chat else None
        if chat:
            prompts = [chat_prompt(body, self.tokenizer, self.limits)]
        else:
            prompts = completion_prompts(body, self.tokenizer, self.limits)
        if len(prompts) * n > self.max_n:
            reason = f"{len(prompts)} prompts x n={n} samples; this worker takes at most {self.max_n} per request"
            raise bad_field("n", reason)
        engine = self.manager.engine
        # A sample's tokens (but its last, never fed back) must fit the context and the whole KV cache: more is
        # refused here by name, never left to fail in the engine (a 500).
        context = min(engine.max_model_len, engine.num_blocks * self.manager.config.block_size + 1)
        for prompt in prompts:
            if len(prompt) > self.max_prompt_len:
                reason = f"is {len(prompt)} tokens; this worker takes at most {self.max_prompt_len}"
                raise APIError(400, f"{prompt_field}: {reason}", prompt_field, code="context_length_exceeded")
        room = context - max(len(prompt) for prompt in prompts)  # tokens the longest prompt leaves in the context
        scoring = None
        if chat:
            max_tokens = fields.integer(body, "max_tokens", room, 1, room)
            max_tokens = fields.integer(body, "max_completion_tokens", max_tokens, 1, room)
            logprobs = self._chat_logprobs(body)
        else:
            scoring = PromptScoring.of(body)
            least = 0 if scoring.scores_prompts else 1  # echo / prompt_logprobs may score the prompt only
            max_tokens = fields.integer(body, "max_tokens", min(DEFAULT_COMPLETION_MAX_TOKENS, room), least, room)
            logprobs = fields.integer(body, "logprobs", None, 0, fields.MAX_COMPLETION_LOGPROBS)
            if fields.integer(body, "best_of", n, 1) != n:
                raise bad_field("best_of", "only best_of = n (or unset) is supported")
        if logprobs is not None and not self.manager.config.return_logprobs:
            raise bad_field("logprobs", "this worker computes no log-probs (return_logprobs=False)")
        stream, include_usage = fields.stream_settings(body)
        default_stops = self.manager.engine.intake.default_sampling.stop_token_ids or ()
        prompt_top = scoring.engine_top(logprobs, max_tokens) if scoring is not None else None
        sampling = fields.sampling_from(
            body, tuple(default_stops), max_tokens, logprobs or 0, prompt_field, prompt_logprobs=prompt_top
        )
        request = fields.GenerationRequest(
            prompts, sampling, n, stream, include_usage, logprobs, fields.flag(body, "return_token_ids"), scoring
        )
        check_answer_size(request, chat, self.max_answer_logprobs)
        named_stops = frozenset(body.get("stop_token_ids") or ())  # checked as token ids by sampling_from
        submission = Submission(self.manager, prompts, sampling, n, self.tokenizer, self.counters, named_stops, adapter)
        prefix = "chatcmpl" if chat else "cmpl"
        answer_id = f"{prefix}-{uuid.uuid4().hex}"
        answer = Answer(chat, request, submission, answer_id, int(time.time()), tools, adapter or self.model_name)
        answer.constraint_param = structured_request(body).param  # the client's name of its constraint, if any
        return answer

    async def compile(self, answer: Answer, request: Any = None) -> None:
        """Compile a request's structured-output constraint in the compile slots, in turn with other clients and
        within the worker's budget (constraint_wait.py); the engine then finds it in its cache.

        Args:
            answer: the prepared request.
            request: the HTTP request (its client's address takes the turn; a client that leaves abandons it).
        Raises:
            APIError: 400 naming the client's field (a spec that does not compile, in the budget or at all, or that
                no sample can follow), 503 busy (too many compiles waiting).
        """
        if answer.constraint_param is None:
            return
        disconnected = getattr(request, "is_disconnected", None)
        await compile_constraint(
            self.compiles, answer.request.sampling, answer.constraint_param, client_address(request), disconnected
        )

    def close(self) -> None:
        """Stop the compile slots, if they are these endpoints' own (a compile in this process is waited for)."""
        if self._own_compiles:
            self.compiles.close()

    @staticmethod
    def _chat_logprobs(body: dict[str, Any]) -> int | None:
        wanted = fields.flag(body, "logprobs")
        top = fields.integer(body, "top_logprobs", 0, 0, fields.MAX_COMPLETION_LOGPROBS)
        if top and not wanted:
            raise bad_field("top_logprobs", "needs logprobs=true")
        return top if wanted else None

    # ---- answers ------------------------------------------------------------------------------------------------
    async def complete(self, answer: Answer, disconnected: Callable[[], Any]) -> bytes:
        """The whole answer's JSON once every choice finished (groups cancelled if the client leaves first), built
        and encoded on a worker thread (a thousand choices with top log-probs are tens of megabytes)."""
        async for _ in answer.submission.deltas(disconnected):
            pass
        for choice in answer.submission.choices:
            if choice.finish_reason in ("error", "abort"):
                raise _ended_early(choice)
        return await asyncio.to_thread(lambda: json_bytes(self._whole(answer)))

    def _whole(self, answer: Answer) -> dict[str, Any]:
        choices = answer.submission.choices
        return {
            "id": answer.id,
            "object": answer.object,
            "created": answer.created,
            "model": answer.model,
            "choices": [self._choice(answer, choice) for choice in choices],
            "usage": _usage(answer),
            **(
                {"prompt_token_ids": answer.request.prompts[0]}
                if answer.chat and answer.request.return_token_ids
                else {}
            ),
        }

    async def stream(self, answer: Answer) -> AsyncIterator[str]:
        """Server-sent events: a chunk per engine output, a usage chunk if asked, then [DONE]. A client that leaves
        mid-stream cancels the request's groups."""
        submission = answer.submission
        base = {"id": answer.id, "object": _chunk_object(answer), "created": answer.created, "model": answer.model}
        try:
            if (
                answer.chat
            ):  # as vLLM: each choice's role first, in index order (the openai client's stream state needs it)
                for choice in submission.choices:
                    entry = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    if answer.request.return_token_ids:
                        entry["token_ids"] = []
                    yield _event({**base, "choices": [{**entry, "finish_reason": None}]})
            async for choice, delta in submission.deltas():
                if choice.finish_reason in ("error", "abort"):
                    error = _ended_early(choice, submission.overflowed)
                    yield _event(error.body())  # not a finish_reason an OpenAI client knows
                    submission.cancel()
                    break
                for chunk in self._chunks(answer, choice, delta):
                    yield _event(chunk)
            else:
                if answer.request.include_usage:
                    yield _event({**base, "choices": [], "usage": _usage(answer)})
            yield "data: [DONE]\n\n"
        finally:
            submission.cancel()  # the client left (the generator was closed) or an error: free the KV blocks

    def _choice(self, answer: Answer, choice: Choice) -> dict[str, Any]:
        request, end = answer.request, len(choice.token_ids)
        entry: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        if answer.tools is not None:
            entry["message"], finish_reason = answer.tools.message(choice.text.text, finish_reason)
        elif answer.chat:
            entry["message"] = {"role": "assistant", "content": choice.text.text}
        else:
            entry["text"] = self._echo(answer, choice) + choice.text.text
            if request.scoring.prompt_logprobs is not None:
                entry["prompt_logprobs"] = self.format.prompt_logprobs(choice)
        entry["logprobs"] = self._logprobs(answer, choice, 0, end)
        entry.update(finish_reason=finish_reason, stop_reason=choice.stop_reason)
        if request.return_token_ids:
            entry.update(prompt_token_ids=choice.prompt_ids, token_ids=choice.token_ids)
        entry.update(choice.rollout_fields())
        return entry

    def _chunks(self, answer: Answer, choice: Choice, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The chunks of one engine output: one, or with tool calls one per delta the parser made (the first
        carries the output's tokens, log-probs and versions; the last its finish reason)."""
        entry: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        pieces = [{"content": delta.text}]
        if answer.tools is not None:
            pieces = answer.tools.deltas(choice.index, delta.text, delta.finished) or [{}]
            finish_reason = answer.tools.finish_reason(choice.index, finish_reason) if delta.finished else None
        if answer.chat:
            entry["delta"] = pieces[0]
        else:
            entry["text"] = (self._echo(answer, choice) if delta.start == 0 else "") + delta.text
            if delta.start == 0 and answer.request.scoring.prompt_logprobs is not None:
                entry["prompt_logprobs"] = self.format.prompt_logprobs(choice)
        entry["logprobs"] = self._logprobs(answer, choice, delta.start, delta.end)
        entry["finish_reason"] = finish_reason if len(pieces) == 1 else None
        if delta.finished:
            entry["stop_reason"] = choice.stop_reason
        if answer.request.return_token_ids:
            if delta.start == 0:
                entry["prompt_token_ids"] = choice.prompt_ids
            entry["token_ids"] = choice.token_ids[delta.start : delta.end]
        entry.update(choice.rollout_fields(delta.start, delta.end))
        entries = [entry]
        for number, piece in enumerate(pieces[1:], 2):
            last = number == len(pieces)
            entries.append({"index": choice.index, "delta": piece, "finish_reason": finish_reason if last else None})
        base = {"id": answer.id, "object": _chunk_object(answer), "created": answer.created, "model": answer.model}
        return [{**base, "choices": [each]} for each in entries]

    def _logprobs(self, answer: Answer, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
        top = answer.request.logprobs
        if top is None:
            return None
        if answer.chat:
            return self.format.chat(choice, start, end, top)
        echo = self._echo(answer, choice)
        offset = len(echo) + self.format.text_offset(choice, start)
        rest = self.format.completion(choice, start, end, top, offset)
        if answer.request.scoring.echo and start == 0:
            return echoed_logprobs(self.format, choice, rest, top)
        return rest

    def _echo(self, answer: Answer, choice: Choice) -> str:
        """The prompt text an `echo` completion starts with ("" without echo)."""
        scoring = answer.request.scoring
        if scoring is None or not scoring.echo:
            return ""
        return scoring.prompt_text(choice.index // answer.request.n, choice.prompt_ids, self.tokenizer)


def _ended_early(choice: Choice, unread: bool = False) -> APIError:
    """The error for a choice the engine ended without finishing it: a failure (500), or an abort (503: the worker
    is shutting down, or a weight update in mode "abort" ended it; retry), or a stream its client did not read."""
    if choice.finish_reason == "error":
        return APIError(500, f"generation failed: {choice.error}", None, "internal_server_error")
    if unread:
        reason = (
            f"the stream was cancelled: its client left over {MAX_UNREAD_OUTPUTS_PER_SAMPLE} outputs per sample unread"
        )
        return APIError(408, reason, None, "invalid_request_error", "stream_not_read")
    reason = "generation was aborted (the worker is stopping, or a weight update aborted in-flight requests); retry"
    return APIError(503, reason, None, "service_unavailable_error", "aborted")


def _usage(answer: Answer) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in answer.request.prompts)
    completion_tokens = sum(len(c.token_ids) for c in answer.submission.choices)
    # Per prompt once (its n choices share its KV): the first choice of each prompt.
    n = max(1, len(answer.submission.choices) // max(1, len(answer.request.prompts)))
    cached = sum(choice.cached_prompt_tokens for choice in answer.submission.choices[::n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chunk_object(answer: Answer) -> str:
    return "chat.completion.chunk" if answer.chat else "text_completion"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

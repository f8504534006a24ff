"""How a generation request is answered once its groups run: the whole OpenAI answer's JSON when every choice
finished, or server-sent events as outputs come (chunks, tool-call deltas, a usage chunk, [DONE]), each choice with
its log-probs, echo, token ids and rollout's `policy_versions` / `kv_version_min`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rollout.service.http.api import openai_fields as fields
from rollout.service.http.api.bridge import MAX_LAGGING_OUTPUTS, MAX_UNREAD_OUTPUTS_PER_SAMPLE, Submission
from rollout.service.http.api.choices import Choice, ChoiceDelta, LogprobFormat
from rollout.service.http.api.prompt_scoring import echoed_logprobs
from rollout.service.http.errors import APIError, json_bytes
from rollout.service.http.tools.chat_tools import ToolCalling


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


class AnswerWriter:
    """Writes the answers of one endpoint set (its log-prob format and tokenizer)."""

    def __init__(self, format: LogprobFormat | None, tokenizer: Any):
        """
        Args:
            format: how log-probs are written (None without a tokenizer: then no request asks for them).
            tokenizer: the served tokenizer (an echo's prompt text), or None.
        """
        self.format = format
        self.tokenizer = tokenizer

    async def complete(self, answer: Answer, disconnected: Callable[[], Any]) -> bytes:
        """The whole answer's JSON once every choice finished (groups cancelled if the client leaves first), built
        and encoded on a worker thread (a thousand choices with top log-probs are tens of megabytes)."""
        async for _ in answer.submission.deltas(disconnected):
            pass
        error = answer_error(answer.submission.choices, answer.submission.overflowed)
        if error is not None:
            try:
                raise error
            finally:  # the traceback keeps this frame, not the error: no cycle to collect
                error = None
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
        async with contextlib.aclosing(self._events(answer)) as events:  # closed with this one (the client left)
            async for event in events:
                # While an event is with the client (sent, or waiting for it to read), what arrives waits on the
                # client: too much then cancels the stream (Submission._arrive).
                answer.submission.sending = True
                yield event
                answer.submission.sending = False

    async def _events(self, answer: Answer) -> AsyncIterator[str]:
        submission = answer.submission
        base = {"id": answer.id, "object": _chunk_object(answer), "created": answer.created, "model": answer.model}
        try:
            if answer.chat:  # as vLLM: each choice's role first, in index order (the openai client's stream state
                # needs it), with the prompt's ids at the top level (where a whole chat answer has them)
                prompt_ids = {"prompt_token_ids": answer.request.prompts[0]} if answer.request.return_token_ids else {}
                for choice in submission.choices:
                    entry = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    if answer.request.return_token_ids:
                        entry["token_ids"] = []
                    yield _event({**base, "choices": [{**entry, "finish_reason": None}], **prompt_ids})
            async for choice, delta in submission.deltas():
                if _ended_by_error(choice, submission.overflowed):
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
            if delta.start == 0 and not answer.chat:  # (chat's: at the top level of its role chunks)
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
        # An echoed prompt's tokens come first, offset by their own texts (as vLLM): the completion's follow them,
        # though the echoed text is the prompt as sent (which its tokens may not spell: `<unk>`, a normalizer).
        echoed = self.format.prompt_length(choice) if answer.request.scoring.echo else 0
        offset = echoed + self.format.text_offset(choice, start)
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


def answer_error(choices: list[Choice], unread: bool) -> APIError | None:
    """The error a whole (non-streamed) answer is refused with when some of its choices ended in one: the gravest
    (an engine's failure, 500, over an unread stream's 408 over a request's own fault, 400, whichever choice came
    first), or None when every choice is an answer.

    Args:
        choices: the answer's choices, finished.
        unread: the request was cancelled because its client left its stream unread.
    """
    errors = [_ended_early(choice, unread) for choice in choices if _ended_by_error(choice, unread)]
    return max(errors, key=lambda error: error.status, default=None)


def _ended_by_error(choice: Choice, unread: bool) -> bool:
    """The choice ended in an error rather than an answer: generation failed, or the request was cancelled because
    its client left its stream unread. An aborted sample (a pause or weight update with mode "abort",
    /abort_requests, the worker stopping) is an answer, as vLLM's: finish_reason "abort", with what it sampled."""
    return choice.finish_reason == "error" or (choice.finish_reason == "abort" and unread)


def _ended_early(choice: Choice, unread: bool = False) -> APIError:
    """The error for a choice `_ended_by_error`: what the request asked for could not be followed (400: bans or a
    grammar that left no token to draw, named in the message: the request's own doing), a failure of the engine
    (500), or a stream its client did not read (408)."""
    if choice.finish_reason == "error" and choice.request_fault:
        return APIError(400, f"generation failed: {choice.error}", None, "invalid_request_error", "nothing_to_draw")
    if choice.finish_reason == "error":
        return APIError(500, f"generation failed: {choice.error}", None, "internal_server_error")
    reason = (
        f"the stream was cancelled: its client left over {MAX_UNREAD_OUTPUTS_PER_SAMPLE} outputs per sample unread (or "
        f"over {MAX_LAGGING_OUTPUTS} waited to be sent)"
    )
    return APIError(408, reason, None, "invalid_request_error", "stream_not_read")


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

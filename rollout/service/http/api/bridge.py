"""An HTTP request's groups on the engine: one group per prompt (n samples each), added to the same manager that
serves ZeroMQ clients, their streamed outputs handed to the request's coroutine on its event loop. A request that
ends early (its client went away, or a later prompt of its batch was refused) cancels its groups, which frees their
KV blocks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.detokenizer import OutputText
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager, QueueFullError
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.outputs import GenerationOutput
from rollout.service.group_counters import GroupCounters
from rollout.service.http.api.choices import Choice, ChoiceDelta
from rollout.service.http.errors import APIError, busy, from_field_error
from rollout.service.observability.tracing import Tracer

# How often a coroutine waiting for a non-streamed answer checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
# Engine outputs a stream may leave unread per sample while its client holds up an event (a client that stops
# reading); past it the request is cancelled, so that an unread stream cannot hold the rest of its generation in
# memory. Per sample: a stream of n=1024 gets 1024 outputs a step, more than an event loop may send in a step's time,
# and must not be cut.
MAX_UNREAD_OUTPUTS_PER_SAMPLE = 64
# Engine outputs a stream may hold whatever the reason, its client's or the event loop's: outputs pile up while the
# loop is busy with other work (other clients' events, a parse) and the engine generates on, and go as soon as it is
# free, so only this much larger backlog cancels a stream whose client is reading. It is what the largest request
# (n=1024) may leave unread, so a lagging loop never makes a request hold more than an unread stream may.
MAX_LAGGING_OUTPUTS = 1024 * MAX_UNREAD_OUTPUTS_PER_SAMPLE


class Submission:
    """The groups of one request and the choices they fill."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        prompts: list[list[int]],
        sampling: SamplingParams,
        n: int,
        tokenizer: Any,
        counters: GroupCounters,
        named_stops: frozenset[int] = frozenset(),
        adapter: str | None = None,
        tracer: Tracer | None = None,
        streamed: bool = False,
        client: str = "http",
    ):
        """
        Args:
            manager: the worker's engine manager.
            prompts: token ids of each prompt.
            sampling: how every sample is drawn.
            n: samples per prompt.
            tokenizer: decodes the choices' text.
            counters: the worker's group counters (groups received and finished, samples by finish reason).
            named_stops: the stop tokens the request named (what a choice's stop_reason may be).
            adapter: the served LoRA adapter the request's `model` names (None: the base model).
            tracer: a `rollout.group` span per prompt's group, as for ZeroMQ groups (None: none).
            streamed: the answer is streamed: a client that leaves its outputs unread cancels it. A whole answer is
                never cancelled so: its size is bounded before it starts, and what waits is the event loop's lag.
            client: who takes admission turns and shares speculative drafts (`GroupSpec.client`): the caller's
                address, so that one HTTP caller's flood of requests queues behind its own turns, not everyone's.
        """
        self._client = client
        self._adapter = adapter
        self._tracer = tracer
        self._spans: list[Any] = []  # per group: its span, and what its outputs added up to (`_GroupTotals`)
        self._manager = manager
        self._prompts = prompts
        self._sampling = sampling
        self._n = n
        self._counters = counters
        self._unfinished_per_group = [n] * len(prompts)
        self.choices = [
            Choice(
                index * n + sample,
                prompt,
                OutputText(
                    tokenizer,
                    prompt,
                    sampling.skip_special_tokens,
                    sampling.stop,
                    sampling.include_stop_str_in_output,
                    sampling.min_new_tokens,
                ),
                frozenset() if sampling.include_stop_str_in_output else frozenset(sampling.stop_token_ids or ()),
                named_stops,
            )
            for index, prompt in enumerate(prompts)
            for sample in range(n)
        ]
        self._queue: asyncio.Queue[tuple[int, GenerationOutput]] = asyncio.Queue()
        self._group_ids: list[str] = []
        self._unfinished = len(self.choices)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.overflowed = False  # cancelled because its client left too many outputs unread
        self._unread_limit = MAX_UNREAD_OUTPUTS_PER_SAMPLE * len(self.choices) if streamed else None
        # True while the answer's writer has handed an event to the client and waits for it to be taken: outputs
        # that arrive meanwhile wait on the client (at other times they wait on the event loop, which is not the
        # client's doing).
        self.sending = False

    def start(self, prompt_field: str, loop: asyncio.AbstractEventLoop) -> None:
        """Add every prompt's group, all or none (on a worker thread: checking a batch of long prompts takes a
        while); their outputs are handed to `loop`, the request's event loop.

        Raises:
            APIError: a prompt the engine refuses (400 naming the field and the prompt's index), a full queue (503
                busy), or a stopped engine (503); nothing of the request is then queued.
        """
        self._loop = loop
        try:
            group_ids = [f"http-{uuid.uuid4().hex}" for _ in self._prompts]
            settings = dict(
                sampling=self._sampling, n=self._n, streaming=True, adapter=self._adapter, client=self._client
            )
            self._manager.add_groups(  # all or none
                [GroupSpec(group_id, prompt, **settings) for group_id, prompt in zip(group_ids, self._prompts)]
            )
            for index, group_id in enumerate(group_ids):
                self._group_ids.append(group_id)
                self._counters.group_received()
                prompt_tokens = len(self._prompts[index])
                span = self._tracer and self._tracer.group_started(group_id, "http", self._n, prompt_tokens)
                self._spans.append(_GroupTotals(span))
                self._manager.register_result_handler(group_id, self._handler(index * self._n))
        except FieldError as error:
            self.cancel()
            raise from_field_error(error, prompt_field) from None
        except QueueFullError as error:
            self.cancel()
            raise busy(str(error)) from None
        except RuntimeError as error:  # the manager stopped (the worker is shutting down, or its engine failed)
            self.cancel()
            raise APIError(503, f"the engine is not serving: {error}", None, "service_unavailable_error") from None

    @property
    def finished(self) -> bool:
        """True once every choice has its final output."""
        return self._unfinished == 0

    async def deltas(self, disconnected: Callable[[], Any] | None = None) -> AsyncIterator[tuple[Choice, ChoiceDelta]]:
        """Yield (choice, what it gained) per engine output until every choice finished.

        Args:
            disconnected: an async callable that says whether the client went away (polled while waiting); the
                groups are then cancelled and `ClientGone` raised.
        """
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while not self.finished:
            try:
                base, output = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                output = None
            # Checked on a clock, not only when idle: a busy request's outputs never leave the queue empty.
            if disconnected is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await disconnected():
                    self.cancel()
                    raise ClientGone
            if output is None:
                continue
            choice = self.choices[base + output.sample_index]
            delta = choice.absorb(output)
            if delta.finished:
                self._unfinished -= 1
                if choice.failed_here and not output.is_finished:  # its answer is an error: nothing more to draw
                    self._cancel_groups()
            yield choice, delta

    def cancel(self) -> None:
        """Cancel the groups not finished yet (their KV blocks are freed; unknown or finished ones are ignored)."""
        if not self.finished:
            self._cancel_groups()

    def _cancel_groups(self) -> None:
        for group_id in self._group_ids:
            self._manager.cancel_request(group_id)

    def _arrive(self, item: tuple[int, GenerationOutput]) -> None:
        """An output reaches the request's loop; a stream whose client holds up an event while too many outputs wait
        is cancelled (its client is not reading), as is one with a backlog past MAX_LAGGING_OUTPUTS."""
        self._queue.put_nowait(item)
        if self._unread_limit is None or self.overflowed:
            return
        backlog = self._queue.qsize()
        if backlog > MAX_LAGGING_OUTPUTS or (self.sending and backlog > self._unread_limit):
            self.overflowed = True
            self.cancel()

    def _handler(self, base: int) -> Callable[[GenerationOutput], None]:
        counters, unfinished, loop, arrive = self._counters, self._unfinished_per_group, self._loop, self._arrive
        group = base // self._n
        totals = self._spans[group]

        def handle(output: GenerationOutput) -> None:  # on the engine thread: quick, and hands over to the loop
            totals.add(output)
            if output.is_finished:
                counters.sample_finished(output.finish_reason)
                unfinished[group] -= 1
                if not unfinished[group]:
                    counters.group_finished()
                    totals.end()
            try:
                loop.call_soon_threadsafe(arrive, (base, output))
            except RuntimeError:  # the loop closed (the server stopped): nobody reads this answer any more
                pass

        return handle


class _GroupTotals:
    """A group's span and what its streamed outputs add up to (engine thread only)."""

    def __init__(self, span: Any):
        self.span = span
        self.tokens, self.reasons, self.versions, self.kv_version_min = 0, [], set(), None

    def add(self, output: GenerationOutput) -> None:
        if self.span is None:
            return
        if output.generated_tokens and not self.tokens:
            Tracer.first_token(self.span)
        self.tokens += len(output.generated_tokens)
        self.versions.update(version for version, _ in output.policy_versions)
        if output.kv_version_min is not None:
            known = self.kv_version_min
            self.kv_version_min = output.kv_version_min if known is None else min(known, output.kv_version_min)
        if output.is_finished:
            self.reasons.append(output.finish_reason)

    def end(self) -> None:
        Tracer.group_ended(self.span, self.tokens, self.reasons, self.versions, self.kv_version_min or 0)


class ClientGone(Exception):
    """The client of a request disconnected before its answer was ready."""

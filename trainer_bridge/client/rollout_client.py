"""RolloutClient: what a trainer process uses to get completions from one or many rollout workers.

One background I/O thread (dispatcher.py) owns every ZeroMQ socket (sockets are not thread-safe); public calls, from any
thread, check their input, hand the I/O thread a command and wait on their own results with a timeout (the generation
calls through the client's `Caller`, caller.py). Groups go to the live worker with the least outstanding work (tokens
still to generate), a whole group to one worker so its prompt is shared. Every worker is pinged every `heartbeat_s`; one
whose ping stays unanswered for `dead_after_s` is declared dead and its unfinished groups are resubmitted to the others
(with none alive, calls wait for one until their timeout). A dead worker that answers again is used again, and the
groups taken from it are cancelled there.

Every group carries a seed (the client draws one if the caller did not), so a resubmitted group reproduces the same
tokens and a stream skips what it already delivered: no group is lost and none is returned twice. That splice is
exact when both workers compute the same numbers (same model, hardware and dtype); otherwise the tokens after the
failover point may come from a different sample.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from rollout.protocol import Completion, Delta
from rollout.validation import is_seconds
from trainer_bridge.client.affinity import PrefixAffinity
from trainer_bridge.client.caller import Caller
from trainer_bridge.client.calls import Call, GroupResult, PromptGroup, RolloutError, WorkerBusy
from trainer_bridge.client.closing_waits import get_unless_closed
from trainer_bridge.client.commands import AskStats, AskVersions, OpenChannel
from trainer_bridge.client.dispatcher import Dispatcher
from trainer_bridge.client.membership import WorkerMembership, check_wait, worker_address_problem
from trainer_bridge.client.update_channel import UpdateChannel

# The most seconds between two pings to a worker, whatever `heartbeat_s` says: a worker cancels the groups of a client
# that sends nothing for its --client-timeout (30 s by default), and pings are all a client waiting on them sends.
MAX_PING_GAP_S = 5.0

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]


class RolloutClient(WorkerMembership):
    """Client of one or several rollout workers. Safe to use from several threads; use `close()` (or `with`)."""

    def __init__(
        self,
        addresses: str | list[str],
        timeout: float = 300.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 10.0,
        connect_timeout: float = 20.0,
        curve_secret_key: str | os.PathLike | bytes | None = None,
        server_public_key: str | os.PathLike | bytes | None = None,
        affinity_slack: float | None = 4.0,
    ):
        """
        Args:
            addresses: one worker address ("tcp://host:port") or a list of them.
            timeout: default seconds any call waits for its answer.
            heartbeat_s: seconds between pings to each worker; at most MAX_PING_GAP_S (5 s) are used, so that a
                worker never takes this client for gone (its --client-timeout) while it waits on long groups.
            dead_after_s: a worker silent this long is dead; its groups go to the others.
            connect_timeout: seconds to wait for the first answer of any worker; when none answered by then, calls
                fail with code "no_workers" naming the addresses (raise it for workers that take long to start).
            curve_secret_key: this client's CurveZMQ key pair (a `.key_secret` file from `rollout-keygen`, or a z85
                secret key), for workers started with `--curve-secret-key`.
            server_public_key: the workers' public key (their `.key` file, or z85); with `curve_secret_key`.
            affinity_slack: a group whose prompt extends a recent one (or of the same `session_id`) goes to that
                one's worker while it is at most this many times the group's cost (n x max_new_tokens) busier than the
                least-loaded worker (`trainer_bridge.client.affinity`); None: by load alone.
        """
        if (curve_secret_key is None) != (server_public_key is None):
            raise ValueError("curve_secret_key and server_public_key: give both (an authenticated worker) or neither")
        for name, value, allow_inf in (
            ("timeout", timeout, False),  # (every call has a timeout: an infinite one is refused by the queues too)
            ("heartbeat_s", heartbeat_s, False),
            ("dead_after_s", dead_after_s, False),
            ("connect_timeout", connect_timeout, True),  # (inf: wait for a first answer as long as it takes)
        ):
            if not is_seconds(value, inf=allow_inf):
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.connect_timeout = connect_timeout
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses:
            raise ValueError("addresses: give at least one worker address")
        for address in addresses:
            problem = worker_address_problem(address)
            if problem is not None:
                raise ValueError(f"addresses: {problem}")
        keys = None if curve_secret_key is None else (curve_secret_key, server_public_key)
        if affinity_slack is not None and (
            isinstance(affinity_slack, bool) or not isinstance(affinity_slack, (int, float)) or not affinity_slack >= 0
        ):
            raise ValueError(f"affinity_slack: must be >= 0 or None, got {affinity_slack!r}")
        self._io = Dispatcher(addresses, keys, min(heartbeat_s, MAX_PING_GAP_S), dead_after_s, connect_timeout)
        # A client dropped without close() stops its I/O thread (which holds the dispatcher, not the client) and closes
        # its sockets, instead of pinging its workers until the process exits.
        weakref.finalize(self, self._io.stop)
        self._io.router.affinity = None if affinity_slack is None else PrefixAffinity(affinity_slack)
        self._started = time.monotonic()
        self._closed = self._io.closed
        self._open_updates: set[str] = set()  # weight updates whose channel is open
        self._updates_lock = threading.Lock()
        self.fleet: Any = None  # the rollout.ray.RolloutFleet this client follows (kept alive with the client)
        self._caller = Caller(self, self._io.command, self._closed)  # (holds this client by a weak proxy)
        # The LoRA adapter groups sample with when they name none: the one this client last pushed (push_weights of
        # a PEFT model), else None (the base model).
        self.adapter: str | None = None

    # ---- public API -------------------------------------------------------------------------------------------
    def generate(self, group: PromptGroup, timeout: float | None = None) -> GroupResult:
        """Sample a group and return all its completions.

        Args:
            group: the prompt, n and sampling settings.
            timeout: seconds to wait (default: the client's).
        Raises:
            RolloutError: refused (names the field), busy (`WorkerBusy`), or no answer within the timeout.
        A wait that ends without the result (timeout, Ctrl-C, any exception) cancels the group on its worker.
        """
        return self._caller.result(group, timeout)

    def stream(self, group: PromptGroup, timeout: float | None = None) -> Iterator[Delta | GroupResult]:
        """Yield `Delta`s (new tokens of one sample) as they come, then the `GroupResult`.

        Args:
            group: the prompt, n and sampling settings.
            timeout: most seconds to wait for each next event.
        """
        yield from self._caller.events(group, timeout)  # (closing this generator closes that one: it cancels)

    def generate_many(self, groups: Iterable[PromptGroup], timeout: float | None = None) -> Iterator[GroupResult]:
        """Submit every group at once and yield each result as it finishes (not in submission order).

        Args:
            groups: the groups.
            timeout: most seconds to wait for the next result.
        """
        yield from self._caller.results(groups, timeout)

    def cancel(self, group_id: str) -> None:
        """Abort a group in flight; its waiter gets the partial completions with finish_reason "abort". A group that
        already finished (or an id this client never sent) is left as it is.

        Args:
            group_id: the group's id: its `PromptGroup.group_id`, or, for a group sent without one, the id its
                `Delta`s and `GroupResult` carry.
        Raises:
            RolloutError: ("bad_request") `group_id` is not a non-empty string.
        """
        if not isinstance(group_id, str) or not group_id:
            reason = (
                f"cancel needs a group's id (a non-empty string), got {group_id!r}: a group sent without one carries "
                "the id it was given in each Delta and GroupResult (group_id)"
            )
            raise RolloutError("bad_request", reason, "group_id")
        self._caller.cancel(group_id)

    def stats(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each live worker's counters (queue depth, running samples, KV blocks, tokens/s, version, uptime).

        Args:
            timeout: most seconds to wait for the answers (default: the client's timeout, at most 10).
        Raises:
            RolloutError: "closed" at once on a closed client, or one closed while it waits; "timeout" when a
                worker did not answer in time (naming each worker that did not).
        """
        if self._closed.is_set():  # nobody would ever answer: fail now, as generate does, not after the timeout
            raise RolloutError("closed", "the client is closed")
        check_wait(timeout)
        deadline = time.monotonic() + (min(self.timeout, 10.0) if timeout is None else timeout)
        self.wait_connected(max(0.0, deadline - time.monotonic()))  # a new client: let its workers answer first
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._io.command(AskStats(replies))
        answers: list[dict[str, Any] | None] = []
        count = None
        try:
            count = get_unless_closed(replies, self._closed, deadline - time.monotonic())
            while len(answers) < count:
                answers.append(get_unless_closed(replies, self._closed, deadline - time.monotonic()))
        except queue.Empty:
            pass
        if count and len(answers) == count:
            return [answer for answer in answers if answer is not None]  # None: a worker lost or removed meanwhile
        # No answer in time from a worker, or no live worker to ask (none connected within the deadline): never an
        # empty list, nor the answers of some workers only (callers check every worker's settings).
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        answered = {answer["address"] for answer in answers if answer is not None}
        workers = [worker for worker in self._io.workers if not worker.retired and worker.address not in answered]
        silent = [worker.address for worker in workers if not worker.alive]
        frozen = [worker.address for worker in workers if worker.alive]  # live, but silent for now (stopped, busy)
        where = f": no answer from {', '.join(silent)}. Is rollout-worker running at that address and port?"
        if frozen:
            where = f": no answer from {', '.join(frozen + silent)} (live, not declared dead yet: stopped or stalled?)"
        raise RolloutError("timeout", f"a worker did not answer stats in time{where if silent or frozen else ''}")

    @property
    def closed(self) -> bool:
        """Whether the client is closed (calls fail with code "closed")."""
        return self._closed.is_set()

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; calls still waiting fail with RolloutError."""
        self._io.stop()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def agenerate(self, group: PromptGroup, timeout: float | None = None) -> GroupResult:
        """asyncio version of `generate`: events come straight from the I/O thread into the event loop (no thread
        per call, so thousands of groups can be awaited at once); cancelling the task cancels the group."""
        return await self._caller.aresult(group, timeout)

    async def astream(self, group: PromptGroup, timeout: float | None = None) -> AsyncIterator[Delta | GroupResult]:
        """asyncio version of `stream`."""
        # Closed with this generator (not later by the event loop's finalizer): it cancels a group not finished.
        async with contextlib.aclosing(self._caller.aevents(group, timeout)) as events:
            async for event in events:
                yield event

    async def agenerate_many(
        self, groups: Iterable[PromptGroup], timeout: float | None = None
    ) -> AsyncIterator[GroupResult]:
        """asyncio version of `generate_many`: each result as it finishes."""
        async with contextlib.aclosing(self._caller.aresults(groups, timeout)) as results:
            async for result in results:
                yield result

    # ---- weight updates (used by trainer_bridge.weights.weight_sync) ---------------------------------------------------
    def open_update_channel(self, update_id: str) -> UpdateChannel:
        """A channel for one weight update: raw sends to chosen workers, and every reply carrying `update_id`.
        `push_weights` drives it; close it when done."""
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._io.command(OpenChannel(update_id, replies))
        with self._updates_lock:
            self._open_updates.add(update_id)
        return UpdateChannel(self._io.command, self._update_closed, update_id, replies, self._closed)

    @property
    def updating(self) -> bool:
        """Whether a weight update (`push_weights`) through this client is open."""
        with self._updates_lock:
            return bool(self._open_updates)

    def _update_closed(self, update_id: str) -> None:
        with self._updates_lock:
            self._open_updates.discard(update_id)

    # ---- caller side ------------------------------------------------------------------------------------------
    def _submit(self, group: PromptGroup, stream: bool, sink: Any = None) -> Call:
        # The one door every group goes through: this client's own calls (its Caller submits here), AsyncRollouts
        # and the TRL modes; a wrapper set on the instance (rollout.benchmarks.grpo.grpo_long_tail's) sees them all.
        return self._caller.submit(group, stream, sink)

    @property
    def min_policy_version(self) -> int:
        """The newest policy version pushed through this client (`push_weights` sets it): groups go to workers
        that serve at least this one whenever one is alive."""
        return self._io.router.min_policy_version

    @min_policy_version.setter
    def min_policy_version(self, version: int) -> None:
        raised = version > self._io.router.min_policy_version
        self._io.router.min_policy_version = version
        if raised and not self._closed.is_set():  # ask the workers' versions now, not at the next heartbeat: calls
            self._io.command(AskVersions())  # wait meanwhile for a worker at this version

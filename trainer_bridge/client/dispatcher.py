"""The RolloutClient's I/O thread: it alone owns the ZeroMQ sockets (one DEALER per worker). Callers hand it commands
through a queue and a waker; it sends groups to workers (routing.py), routes every reply to its call, pings every
worker, fails groups over from dead workers and gives them back to workers that return (liveness.py), and adds or
removes workers while running (a `RolloutFleet` follows its workers this way).

A worker gets groups only once it answered (nothing queued for a worker not up yet can reach it twice); calls made
before any answered wait (parked), spread over the workers that answer within FIRST_CONTACT_GRACE_S of the first;
when none answered within `connect_timeout`, or all refused this client's key, calls fail with "no_workers".
Workers keep their index for the client's life: a removed one stays in `workers`, retired.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import zmq

from rollout import protocol as p
from rollout.mailbox import drain
from rollout.protocol.reply_frames import FrameError, unpack_message
from rollout.protocol.sockets import Waker
from trainer_bridge.client.calls import Call, GroupResult, RolloutError, WorkerBusy, WorkerLost, aborted_result
from trainer_bridge.client.commands import (
    AddWorker,
    AskStats,
    AskVersions,
    CancelCall,
    CloseChannel,
    Command,
    OpenChannel,
    RemoveWorker,
    SendRaw,
    Submit,
)
from trainer_bridge.client.links import WorkerLink
from trainer_bridge.client.liveness import Liveness
from trainer_bridge.client.reply_checks import reply_problem
from trainer_bridge.client.routing import CallRouter
from trainer_bridge.client.stream_splice import splice

logger = logging.getLogger("trainer_bridge.client")


class Dispatcher:
    """The I/O thread's state and loop (see the module docstring); where groups go is its `CallRouter`'s. Only
    `command`, `workers` (read-only), `router.min_policy_version`, `router.affinity` and `closed` are for other
    threads."""

    def __init__(
        self,
        addresses: list[str],
        keys: tuple[Any, Any] | None,
        heartbeat_s: float,
        dead_after_s: float,
        connect_timeout: float,
    ):
        """
        Args:
            addresses: the workers' addresses (checked by the caller).
            keys: (this client's secret key, the workers' public key) for CurveZMQ, or None.
            heartbeat_s: seconds between pings to each worker.
            dead_after_s: a worker silent this long is dead; its groups go to the others.
            connect_timeout: seconds to wait for the first answer of any worker.
        Raises:
            ValueError: a key that cannot be loaded.
        """
        self._context = zmq.Context()
        # Sockets linger 0 unless their close says otherwise, libzmq's monitor sockets included (`term()` must not
        # wait for the events of a monitor closed first: the worker's context does the same).
        self._context.set(zmq.BLOCKY, False)
        self._keys = keys
        try:
            self.workers = [WorkerLink(self._context, address, keys) for address in addresses]
        except (ValueError, zmq.ZMQError) as error:
            self._context.destroy(linger=0)
            raise ValueError(f"curve_secret_key/server_public_key: {error}") from None
        self._poller = zmq.Poller()
        self._sockets: dict[Any, int] = {}  # a worker's socket -> its index
        self._monitors: dict[Any, int] = {}  # a worker's monitor socket -> its index
        self.router = CallRouter(self.workers, connect_timeout, heartbeat_s)
        self._stats_sinks: list[deque[queue.SimpleQueue]] = [deque() for _ in self.workers]
        self._channels: dict[str, queue.SimpleQueue] = {}  # weight update id -> its replies
        self.liveness = Liveness(  # pings, failover and revival (only this thread calls it)
            self.workers,
            self.router,
            self._channels,
            self._stats_sinks,
            self._send,
            heartbeat_s,
            dead_after_s,
            connect_timeout,
        )
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._waker = Waker()
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-client", daemon=True)
        self._thread.start()

    def command(self, command: Command) -> None:
        """Hand the I/O thread a command (any thread)."""
        self._commands.put(command)
        self._waker.wake()

    def stop(self) -> None:
        """Stop the I/O thread and close the sockets; calls still waiting fail with RolloutError."""
        if not self.closed.is_set():
            self.closed.set()
            self._waker.wake()
            if threading.current_thread() is not self._thread:  # (a finalizer may run on it)
                self._thread.join(10)

    def _loop(self) -> None:
        self._poller.register(self._waker.reader, zmq.POLLIN)
        for index in range(len(self.workers)):
            self._watch(index)
        try:
            while not self.closed.is_set():
                for sock, _ in self._poller.poll(self.router.poll_ms()):
                    if sock is self._waker.reader or sock == self._waker.reader.fileno():
                        self._waker.drain()
                    elif sock in self._monitors:
                        self.liveness.on_monitor(self._monitors[sock])
                    elif sock in self._sockets:  # (not a worker removed earlier in this same poll)
                        self._receive(self._sockets[sock])
                self._run_commands()
                self.liveness.heartbeat()
        except BaseException:
            logger.exception("rollout client I/O thread failed")
            raise
        finally:
            self.closed.set()  # later calls fail at once instead of waiting for a dead thread
            for call in self.router.calls.values():
                call.events.put(RolloutError("closed", "the client was closed"))
            for worker in self.workers:
                if not worker.retired:
                    worker.close()
            self._context.term()
            self._waker.close()
            # Only this thread used it, and it holds this dispatcher's `_send`: a cycle that would keep the closed
            # client's memory until a garbage collection.
            del self.liveness

    def _run_commands(self) -> None:
        for command in drain(self._commands):
            if isinstance(command, Submit):
                self._submit(command.call)
            elif isinstance(command, CancelCall):
                self._cancel(command.group_id, command.call)
            elif isinstance(command, OpenChannel):
                self._channels[command.update_id] = command.replies
            elif isinstance(command, CloseChannel):
                self._channels.pop(command.update_id, None)
            elif isinstance(command, SendRaw):
                self._send(command.worker, command.message, command.data)
            elif isinstance(command, AddWorker):
                self._add_worker(command)
            elif isinstance(command, RemoveWorker):
                self._remove_worker(command)
            elif isinstance(command, AskVersions):
                self.liveness.ping_live()
            elif isinstance(command, AskStats):
                live = [index for index, worker in enumerate(self.workers) if worker.alive]
                command.replies.put(len(live))
                for index in live:
                    self._stats_sinks[index].append(command.replies)
                    self._send(index, p.Stats())

    def _submit(self, call: Call) -> None:
        held = self.router.calls.get(call.group.group_id)
        if held is not None and held.abandoned:  # a retry after its caller gave up (cancelled on its worker, which
            self.router.finish(held)  # may not have answered yet): the id is the retry's, its late answers ignored
            call.attempts = held.attempts  # (the retry's wire ids stay clear of the cancelled run's, still running)
        unreachable = self.router.unreachable()
        if unreachable is not None:
            call.events.put(RolloutError("no_workers", unreachable))
        elif call.group.group_id in self.router.calls:
            message = "a group with this id is still in flight on this client"
            call.events.put(RolloutError("duplicate_group", message, "group_id"))
        else:
            self.router.add(call)

    def _cancel(self, group_id: str, owner: Call | None) -> None:
        router = self.router
        call = router.calls.get(group_id)
        if call is None or (owner is not None and call is not owner):  # (another call's group: not the owner's)
            return
        call.cancelled = True
        call.abandoned = call.abandoned or owner is not None  # (a cancel by id alone leaves its waiter waiting)
        if call.worker is not None:
            self._send(call.worker, p.Cancel(call.wire_id))
        else:  # parked: nobody has it, so it ends here, aborted (what a worker would have answered the cancel)
            router.calls.pop(group_id)
            router.by_wire.pop(call.wire_id, None)
            router.parked = [c for c in router.parked if c is not call]
            call.events.put(aborted_result(call.group))

    def _watch(self, index: int) -> None:
        worker = self.workers[index]
        self._poller.register(worker.socket, zmq.POLLIN)
        self._poller.register(worker.monitor, zmq.POLLIN)
        self._sockets[worker.socket] = index
        self._monitors[worker.monitor] = index

    def _add_worker(self, command: AddWorker) -> None:
        """Connect to one more worker (nothing when one at this address is already connected): it gets groups once
        it answered and serves the newest pushed weights."""
        if not any(worker.address == command.address and not worker.retired for worker in self.workers):
            try:
                link = WorkerLink(self._context, command.address, self._keys)
            except (ValueError, zmq.ZMQError) as error:  # the caller raises it; the client goes on
                command.error = f"{command.address}: {error}"
                command.done.set()
                return
            self.workers.append(link)
            self._stats_sinks.append(deque())
            self._watch(len(self.workers) - 1)
        command.done.set()

    def _remove_worker(self, command: RemoveWorker) -> None:
        """Stop using a worker: its groups go to the others (and are cancelled on it), open weight updates go on
        without it, its socket closes; it keeps its index, retired."""
        for index, worker in enumerate(self.workers):
            if worker.address != command.address or worker.retired:
                continue
            worker.alive = False
            self.liveness.failover(index)
            for wire_id in worker.taken_away:
                self._send(index, p.Cancel(wire_id))
            worker.retired = True
            for sock in (worker.socket, worker.monitor):
                self._poller.unregister(sock)
            self._sockets.pop(worker.socket)
            self._monitors.pop(worker.monitor)
            worker.close(linger_ms=500)  # the cancels above may still go out
        command.done.set()

    def _send(self, index: int, message: p.Message, data: list | None = None) -> None:
        if self.workers[index].retired:
            channel = self._channels.get(getattr(message, "update_id", None))
            if channel is not None:  # a push that chose this worker before it was removed: it goes on without it
                channel.put((index, WorkerLost(self.workers[index].address)))
            return
        try:
            if data:  # tensor bytes: handed to ZeroMQ without a copy (it keeps a reference until sent)
                self.workers[index].socket.send_multipart(p.encode(message) + data, zmq.NOBLOCK, copy=False)
            else:
                self.workers[index].socket.send_multipart(p.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the heartbeat will declare the worker dead and resubmit its groups

    def _receive(self, index: int) -> None:
        worker = self.workers[index]
        while True:
            try:
                frames = worker.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            worker.unanswered_since = None
            try:
                message = p.decode(frames)
            except p.ProtocolError as error:  # a reply to a call that cannot be read fails the call, naming why,
                message = None  # instead of leaving it to wait for its timeout
                if error.group_id is not None:
                    reason = f"the worker's reply could not be read: {error}"
                    message = p.Error("bad_reply", reason, error.field, error.group_id)
            if isinstance(message, (p.Pong, p.WeightsCommitted)):  # before a revival routes calls by it
                before = worker.policy_version
                worker.policy_version = message.policy_version if isinstance(message, p.Pong) else message.version
                if worker.alive and worker.policy_version > before:  # calls parked for a newer worker may go now
                    self.router.release_parked()
            if not worker.alive:
                self.liveness.revive(index)
            if message is None:
                logger.warning("undecodable message from %s", worker.address)
                continue
            try:
                unpack_message(message, frames[1:])
            except FrameError as error:  # the call fails, naming why, instead of waiting for its timeout
                reason = f"the worker's reply arrays could not be read: {error}"
                message = p.Error("bad_reply", reason, error.field, getattr(message, "group_id", None))
            self._handle(index, message)

    def _handle(self, index: int, message: p.Message) -> None:
        channel = self._channels.get(getattr(message, "update_id", None))
        if channel is not None:
            channel.put((index, message))
            return
        if isinstance(message, p.StatsReply):
            if self._stats_sinks[index]:
                self._stats_sinks[index].popleft().put({"address": self.workers[index].address, **message.stats})
            return
        call = self.router.by_wire.get(getattr(message, "group_id", None))
        if call is None or call.worker != index:
            return  # a pong, or a late answer from a worker the group was taken away from
        problem = reply_problem(call.group, message)
        if problem is not None:  # the call fails, naming why (and the worker is told to cancel the group)
            reason = f"the worker's reply does not fit the group: {problem[0]}: {problem[1]}"
            message = p.Error("bad_reply", reason, problem[0], message.group_id)
        group_id = call.group.group_id
        if isinstance(message, p.Delta):
            delta = splice(call, message)
            if delta is not None:
                call.events.put(delta)
        elif isinstance(message, p.GroupResult):
            self.router.finish(call)
            call.events.put(GroupResult(group_id, message.prompt_ids, message.completions))
        elif isinstance(message, p.Error):
            if message.code == "unknown_group":  # answers a cancel that crossed the result: not this call's fate
                return
            self.router.finish(call)
            if message.code == "bad_reply":  # made here: the worker would go on generating a group nobody reads
                self._send(index, p.Cancel(message.group_id))
            kind = WorkerBusy if message.code == "busy" else RolloutError
            call.events.put(kind(message.code, message.message, message.field))

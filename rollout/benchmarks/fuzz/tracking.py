"""Bookkeeping of `send_fuzz`: each DEALER socket and the cases in flight on it, attributing every reply to its case
(sentinel pongs, deferred group_results and adapter unloads, cancels answered by their group's result, unsolicited
pongs), concluding
cases into the `FuzzReport`, stalls and liveness pings, and retired sockets still owed group_results."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from rollout import protocol as p
from rollout.benchmarks.fuzz.cases import FuzzCase
from rollout.benchmarks.fuzz.report import FuzzReport
from rollout.constraints import CONSTRAINT_FIELDS


@dataclass
class _Tracked:
    case: FuzzCase
    sent_at: float
    sentinel: int  # the nonce of the ping sent after it
    replies: list[p.Message] = field(default_factory=list)
    done_at: float | None = None


class _Socket:
    """One DEALER socket (one client identity as the worker sees it) and the cases in flight on it."""

    def __init__(self, context: zmq.Context, address: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(address)
        self.pending: deque[_Tracked] = deque()  # sent, sentinel pong not yet back
        self.retired_at = 0.0
        self.deferred: dict[str, deque[_Tracked]] = {}  # group id -> accepted generates awaiting their result
        self.cancelling: dict[str, list[_Tracked]] = {}  # group id -> cancels answered by that group's result
        self.unloading: dict[str, _Tracked] = {}  # update id -> an accepted adapter_unload awaiting its answer

    def close(self) -> None:
        self.socket.close(linger=0)


def _receive(sock: _Socket, report: FuzzReport, latencies: list, timeout_s: float) -> bool:
    """Take every reply waiting (waiting up to `timeout_s` for the first); False when none came."""
    got = False
    while sock.socket.poll(int(timeout_s * 1000) if not got else 0):
        got = True
        frames = sock.socket.recv_multipart()
        try:
            message = p.decode(frames)
        except p.ProtocolError:
            message = p.Error("undecodable_reply", repr(frames[:1])[:200])
        _attribute(sock, message, report, latencies)
    return got


def _attribute(sock: _Socket, message: p.Message, report: FuzzReport, latencies: list) -> None:
    if isinstance(message, p.Pong) and any(t.sentinel == message.nonce for t in sock.pending):
        # Everything the worker will say about a case came before its sentinel pong (answers to accepted generates
        # excepted). Cases before it whose pong never came are concluded with it.
        while sock.pending:
            tracked = sock.pending.popleft()
            tracked.done_at = time.monotonic()
            latencies.append((tracked.done_at - tracked.sent_at, tracked.case))
            if not tracked.replies and tracked.case.group_id is not None:
                sock.deferred.setdefault(tracked.case.group_id, deque()).append(tracked)
            elif not tracked.replies and tracked.case.unloads is not None:
                sock.unloading[tracked.case.unloads] = tracked
            elif not tracked.replies and tracked.case.cancels in sock.deferred:
                sock.cancelling.setdefault(tracked.case.cancels, []).append(tracked)
            else:
                _conclude(tracked, report)
            if tracked.sentinel == message.nonce:
                return
        return
    update_id = getattr(message, "update_id", None)
    # The case in flight is answered before its sentinel: a reply naming its id is its own, not an earlier unload's
    # of the same id (fuzzed ids repeat) whose answer is still to come.
    in_flight = bool(sock.pending) and sock.pending[0].case.update_id == update_id
    unloaded = None if in_flight and not isinstance(message, p.AdapterUnloaded) else sock.unloading.pop(update_id, None)
    if unloaded is not None:  # the engine thread's answer to an adapter_unload, after its sentinel
        unloaded.replies.append(message)
        _conclude(unloaded, report)
        return
    group_id = getattr(message, "group_id", None)
    answers_group = isinstance(message, (p.GroupResult, p.Delta)) or _compile_refusal(sock, message)
    if answers_group and group_id in sock.deferred:
        waiting = sock.deferred[group_id]
        tracked = waiting[0]
        tracked.replies.append(message)
        if isinstance(message, (p.GroupResult, p.Error)):
            waiting.popleft()
            if not waiting:
                del sock.deferred[group_id]
            _conclude(tracked, report)
            for cancel in sock.cancelling.pop(group_id, []):
                cancel.replies.append(message)
                _conclude(cancel, report)
        return
    if isinstance(message, (p.GroupResult, p.Delta)):
        # An accepted generate whose answer came before its sentinel pong (or a stream's deltas): its case.
        for tracked in sock.pending:
            if tracked.case.group_id == group_id:
                tracked.replies.append(message)
                return
        report.stray_replies += 1  # the answer to a case already concluded (it came after every wait)
        return
    if isinstance(message, p.Pong) and not (sock.pending and sock.pending[0].case.nonce == message.nonce):
        # Not the answer to the case in flight: the worker probes clients with unsolicited pongs (nonce -1) when a
        # connection closes (e.g. after this sender replaced its socket).
        report.unsolicited_pongs += 1
        return
    if sock.pending:
        sock.pending[0].replies.append(message)


def _compile_refusal(sock: _Socket, message: p.Message) -> bool:
    """A generate with a structured-output constraint is compiled off the serving loop: its refusal (a bad spec,
    naming `sampling.<constraint>` and its group) may come after the sentinel, like an accepted group's result."""
    if not isinstance(message, p.Error) or message.field not in {f"sampling.{name}" for name in CONSTRAINT_FIELDS}:
        return False
    return not any(tracked.case.group_id == message.group_id for tracked in sock.pending)


def _conclude(tracked: _Tracked, report: FuzzReport) -> None:
    case = tracked.case
    stats = report.by_category.setdefault(case.category, {"sent": 0, "answered": 0, "errors": 0, "unanswered": 0})
    stats["sent"] += 1
    report.header_decodable += case.header_decodable
    if case.expect == "error":
        report.expected_error += 1
        report.decodable_owed_error += case.header_decodable
    else:
        report.accepted_requests += 1
        if case.intended_malformed:
            report.lenient += 1
            report.lenient_cases.append(case)
    replies = [r for r in tracked.replies if not isinstance(r, p.Delta)] or tracked.replies
    if not replies:
        report.unanswered += 1
        stats["unanswered"] += 1
        report.unanswered_cases.append(case)
        return
    report.answered += 1
    stats["answered"] += 1
    first = replies[0]
    if isinstance(first, p.Error):
        report.error_replies += 1
        stats["errors"] += 1
        report.header_decodable_errors += case.header_decodable
        if case.expect == "error":
            report.decodable_owed_error_answered += case.header_decodable
        report.error_codes[first.code] = report.error_codes.get(first.code, 0) + 1
        if first.code == "internal":
            report.internal_cases.append((case, first.message[:200]))
    else:
        report.other_replies += 1
        if case.expect == "error":
            report.expected_error_answered_ok += 1
            report.wrong_answer_cases.append(case)


def _stalled(
    sock: _Socket, report: FuzzReport, address: str, context: zmq.Context, alive: Callable[[], bool] | None
) -> None:
    """No reply within the wait while cases are in flight: is the worker still there?"""
    report.stalls += 1
    if (alive is None or alive()) and _pings(context, address, 5.0):
        # Alive but these cases were never answered: give up on them (a later sentinel pong closes them anyway).
        while sock.pending:
            _conclude(sock.pending.popleft(), report)
        return
    report.worker_stopped = True
    report.suspects = [tracked.case for tracked in sock.pending]
    while sock.pending:
        _conclude(sock.pending.popleft(), report)


def _drain_pending(
    sock: _Socket,
    report: FuzzReport,
    latencies: list,
    reply_timeout_s: float,
    context: zmq.Context,
    alive: Callable[[], bool] | None,
) -> None:
    """Wait (bounded) until every case sent on this socket is past its sentinel pong."""
    while sock.pending and not report.worker_stopped:
        if not _receive(sock, report, latencies, reply_timeout_s):
            _stalled(sock, report, report.address, context, alive)


def _poll_retired(
    retired: list[_Socket], report: FuzzReport, latencies: list, deferred_timeout_s: float, wait_s: float
) -> list[_Socket]:
    """Take the group_results that came to earlier sockets; close those that owe nothing more (or waited past
    `deferred_timeout_s`: what they still owed is unanswered). Returns the ones still open."""
    still = []
    for sock in retired:
        if sock.deferred or sock.unloading:
            _receive(sock, report, latencies, wait_s / max(1, len(retired)))
        if (sock.deferred or sock.unloading) and time.monotonic() - sock.retired_at < deferred_timeout_s:
            still.append(sock)
            continue
        _conclude_deferred(sock, report)
        sock.close()
    return still


def _conclude_deferred(sock: _Socket, report: FuzzReport) -> None:
    for waiting in [*sock.deferred.values(), *sock.cancelling.values(), [*sock.unloading.values()]]:
        for tracked in waiting:
            _conclude(tracked, report)
    sock.deferred.clear()
    sock.cancelling.clear()
    sock.unloading.clear()


def _pings(context: zmq.Context, address: str, timeout_s: float) -> bool:
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(address)
    try:
        probe.send_multipart(p.encode(p.Ping(1)))
        return bool(probe.poll(int(timeout_s * 1000)))
    finally:
        probe.close()

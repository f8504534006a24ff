"""`send_fuzz`: send the cases from raw DEALER sockets, each followed by a sentinel ping, within a window, rotating
the socket (the client identity) every `rotate_every` cases, and account for every reply."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

import zmq

from rollout import protocol as p
from rollout.benchmarks.fuzz.cases import FuzzCase
from rollout.benchmarks.fuzz.generation import fuzz_cases
from rollout.benchmarks.fuzz.report import FuzzReport
from rollout.benchmarks.fuzz.serving import check_serving
from rollout.benchmarks.fuzz.tracking import (
    _conclude_deferred,
    _drain_pending,
    _poll_retired,
    _receive,
    _Socket,
    _stalled,
    _Tracked,
)
from rollout.benchmarks.fuzz.values import OVERSIZED_ITEMS, SENTINEL_BASE


def send_fuzz(
    address: str,
    count: int,
    seed: int = 0,
    *,
    rotate_every: int = 100,
    window: int = 32,
    reply_timeout_s: float = 10.0,
    deferred_timeout_s: float = 60.0,
    slow_s: float = 1.0,
    check: bool = True,
    alive: Callable[[], bool] | None = None,
    stop: Callable[[], bool] | None = None,
    cases: Iterable[FuzzCase] | None = None,
    max_items: int = OVERSIZED_ITEMS[-1],
    report: FuzzReport | None = None,
) -> FuzzReport:
    """Send `count` fuzz cases of `seed` to the worker at `address` and account for every reply.

    Args:
        address: the worker's ZeroMQ address.
        count, seed: which cases (`fuzz_cases(count, seed)`, unless `cases` is given).
        rotate_every: cases per socket (a fresh client identity each time).
        window: most cases in flight (sent, their sentinel pong not back).
        reply_timeout_s: a wait this long without any reply while cases are in flight is a stall: the worker is
            probed; one that does not answer a fresh ping ends the run (`worker_stopped`).
        deferred_timeout_s: how long accepted generates may take to return their group_result.
        slow_s: cases the worker took longer than this to get past are listed in `slow_cases`.
        check: after the fuzz, `check_serving` (hello, a greedy generate, the weight-update slot).
        alive: optional liveness test of the worker (e.g. its process is running), checked on stalls.
        stop: optional; when it returns True, sending stops early (what was sent is still accounted for).
        cases: optional cases to send instead of `fuzz_cases(count, seed, max_items)`.
        max_items: the largest oversized value (see `fuzz_cases`).
        report: optional FuzzReport to fill (its counts are live while this runs, e.g. for another thread).
    """
    report = report if report is not None else FuzzReport(address, seed)
    context = zmq.Context()
    start = time.monotonic()
    latencies: list[tuple[float, FuzzCase]] = []
    current: _Socket | None = None
    retired: list[_Socket] = []  # earlier sockets still awaiting group_results of accepted generates
    sentinel = itertools.count()
    try:
        for case in cases if cases is not None else fuzz_cases(count, seed, max_items):
            if stop is not None and stop():
                break
            if current is None or report.sent % rotate_every == 0:
                if current is not None:
                    _drain_pending(current, report, latencies, reply_timeout_s, context, alive)
                    current.retired_at = time.monotonic()
                    retired.append(current)
                if report.worker_stopped:
                    break
                current = _Socket(context, address)
                report.identities += 1
            retired = _poll_retired(retired, report, latencies, deferred_timeout_s, 0.0)
            nonce = SENTINEL_BASE + next(sentinel)
            current.socket.send_multipart(case.frames)
            current.socket.send_multipart(p.encode(p.Ping(nonce)))
            current.pending.append(_Tracked(case, time.monotonic(), nonce))
            report.sent += 1
            report.bytes_sent += case.nbytes
            _receive(current, report, latencies, 0)
            while len(current.pending) >= window and not report.worker_stopped:
                if not _receive(current, report, latencies, reply_timeout_s):
                    _stalled(current, report, address, context, alive)
            if report.worker_stopped:
                break
        if current is not None:
            _drain_pending(current, report, latencies, reply_timeout_s, context, alive)
            current.retired_at = time.monotonic()
            retired.append(current)
        report.send_seconds = time.monotonic() - start
        while retired and not report.worker_stopped:
            retired = _poll_retired(retired, report, latencies, deferred_timeout_s, 0.2)
        for sock in retired:  # the worker stopped: what it still owed is unanswered
            _conclude_deferred(sock, report)
    finally:
        context.destroy(linger=0)
    report.seconds = time.monotonic() - start
    latencies.sort(key=lambda item: -item[0])
    report.max_latency_s = latencies[0][0] if latencies else 0.0
    report.slow_cases = [item for item in latencies if item[0] > slow_s]
    if check and not report.worker_stopped:
        report.serving = check_serving(address)
    return report

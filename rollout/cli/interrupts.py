"""Ctrl-C while a command starts: never a traceback of wherever it landed, nor a process aborted by it.

A KeyboardInterrupt raised inside an import leaves a module half-initialised, and a later import fails with an
unrelated error (numpy's RecursionError, surfacing as transformers' "Could not import module 'AttentionInterface'");
one raised inside a C++ extension's module init aborts the process ("terminate called after throwing an instance
of 'pybind11::error_already_set'"). So the imports of torch and transformers run under `deferring_sigint` (the
interrupt waits for them, seconds), and what runs after them under `recording_sigint`, whose record tells an error
that an interrupt caused from a real failure. A SIGINT ignored on entry (a background job of a non-interactive
shell) stays ignored under both, and a command run from a thread other than the main one (which may not set a
handler) keeps the handler it has. A command that stops as for Ctrl-C on SIGTERM (`rollout-eval`, which writes the
rows it has) asks for it (`terminate=True`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def _sigint_recorded(
    raise_at_once: bool, terminate: bool = False, into: list[int] | None = None
) -> Iterator[list[int]]:
    """Within the block, a SIGINT (and a SIGTERM with `terminate`) is recorded (in `into` when given: an outer
    block's record), then raises KeyboardInterrupt now (`raise_at_once`) or at the block's end; the previous
    handlers are back on exit."""
    received: list[int] = [] if into is None else into
    recorded = len(received)
    if threading.current_thread() is not threading.main_thread():
        yield received  # only the main thread may set a handler; a command run from another thread keeps its own
        return
    wanted = (signal.SIGINT, signal.SIGTERM) if terminate else (signal.SIGINT,)
    previous = {signum: signal.getsignal(signum) for signum in wanted}
    caught = [signum for signum, handler in previous.items() if handler is not signal.SIG_IGN]

    def record(signum: int, frame: object) -> None:
        received.append(signum)
        if raise_at_once:
            raise KeyboardInterrupt

    for signum in caught:
        signal.signal(signum, record)
    try:
        yield received
    finally:
        for signum in caught:
            signal.signal(signum, previous[signum])
    if len(received) > recorded and not raise_at_once:
        raise KeyboardInterrupt


def recording_sigint(terminate: bool = False) -> contextlib.AbstractContextManager[list[int]]:
    """SIGINT raises KeyboardInterrupt as Python's default handler does, and is recorded first: the list yielded
    holds the signal's number once one arrived, so that any error after it is reported as the interrupt.

    Args:
        terminate: SIGTERM too (a command that stops on it as on Ctrl-C).
    """
    return _sigint_recorded(raise_at_once=True, terminate=terminate)


def deferring_sigint(
    terminate: bool = False, into: list[int] | None = None
) -> contextlib.AbstractContextManager[list[int]]:
    """SIGINT is recorded and raised as KeyboardInterrupt when the block ends (its imports complete), not inside it.

    Args:
        terminate: SIGTERM too.
        into: record the signal there (the list of an enclosing `recording_sigint`, which says which one came).
    """
    return _sigint_recorded(raise_at_once=False, terminate=terminate, into=into)

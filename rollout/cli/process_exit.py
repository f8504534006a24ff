"""A console script's process ends as soon as its command is done.

A process that imported torch and transformers holds hundreds of thousands of Python objects; the interpreter's
exit walks them all in a last garbage collection and frees them one by one: 1.5-3 s after a worker logged
"stopped", time a supervisor (systemd, Kubernetes, a Ray fleet) or a test waits for nothing. Once the command has
closed what it owns (sockets, servers, the engine, files), `exit_now` does what the interpreter's exit does that
anyone can see (wakes open thread pools and joins the threads still running, runs the exit hooks: logging's flush,
OpenTelemetry's export; flushes standard output and error) and ends the process with its status; the memory goes
back to the system whole. A command that raises ends as Python ends it, with its traceback; one whose reader of
standard output went away (`| head`) ends quietly with status 1.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_now(status: int) -> NoReturn:
    """End the process with `status` after joining its other non-daemon threads, running its exit hooks and flushing
    its standard streams, skipping the interpreter's teardown of every object.

    Args:
        status: the exit status.
    """
    # What the interpreter's exit does first: wake the idle workers of open thread pools (the hooks
    # `threading._register_atexit` keeps, not `atexit`'s), then join every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with that stream closed
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(status)


def run_console_script(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> NoReturn:
    """Run a console script's `main` and end the process with its status (`exit_now`).

    Args:
        main: the script's main function; returns its exit status.
        argv: its arguments (None: the command line's).
    """
    try:
        status = main(argv)
    except SystemExit as error:  # a usage error (argparse), or sys.exit() in the command
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
        status = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BrokenPipeError:  # whoever read its output stopped reading (`| head`): as a shell tool ends, quietly
        sys.stdout = None  # nothing more can reach it (the flush at exit would fail again)
        status = 1
    exit_now(status)

"""Process control for child processes (benchmark systems and sections, compile jobs): nothing started outlives its
parent.

- `die_with_parent` (run in a child before its program starts): Linux kills the child when the thread that started
  it ends, so a parent killed outright (SIGKILL, a device's time limit) takes its children along, even in sessions of
  their own where no signal to its group reaches them.
- `interrupt_on_signals`: SIGINT and SIGTERM raise KeyboardInterrupt, so that a parent unwinds and kills its
  children's groups on the way out.
- `kill_group`: SIGTERM to a child's group, a grace period, then SIGKILL, with further signals held off meanwhile.
- `process_age_s`: how long this process has run, so that a time budget counts its own start-up (imports).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent thread ends
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
TERM_GRACE_S = 10.0  # how long a group may take to end its own children after SIGTERM, before SIGKILL
_STOPPING = (signal.SIGINT, signal.SIGTERM)


def die_with_parent(parent_pid: int) -> None:
    """In a child, between fork and exec (`preexec_fn`): ask Linux for SIGKILL when the parent thread ends, and end
    at once if the parent (`parent_pid`, read before the fork) is already gone. A no-op outside Linux.

    Args:
        parent_pid: `os.getpid()` of the parent, taken before it started the child.
    """
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def interrupt_on_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in this (main) thread, so that whatever runs child processes
    unwinds and kills their groups. SIGINT too: a shell starts background jobs with it ignored, and Python then never
    raises KeyboardInterrupt by itself.

    Returns:
        The handlers replaced, by signal number (for the caller to put back).
    """
    return {signum: signal.signal(signum, _raise_interrupt) for signum in _STOPPING}


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def kill_group(process: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """End `process`'s group (it leads its own session): SIGTERM first, so that a child which runs children of its
    own in groups of their own kills those on its way out, then SIGKILL for whatever is left. A second SIGINT or
    SIGTERM meanwhile waits until the group is gone (then raises as usual), rather than cutting the kill short.

    Args:
        process: a process started with `start_new_session=True`.
        grace_s: how long the group has to end after SIGTERM.
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                return
            if signum == signal.SIGTERM:
                try:
                    process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)


def process_age_s() -> float:
    """Seconds since this process started (its imports included), from /proc on Linux; 0.0 where unknown."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0

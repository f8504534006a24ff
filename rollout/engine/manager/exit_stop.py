"""Managers still running when the interpreter exits are stopped first (`stop_at_exit` registers one as its thread
starts): a script that ends, raises or is interrupted without `stop()` would otherwise leave the engine thread
running torch code while the interpreter finalizes, and the process aborts ("terminate called without an active
exception", exit status 134). Their unfinished requests end "abort", as at any stop."""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import Any

logger = logging.getLogger("rollout.engine.manager")

# Most seconds to wait at exit, for all managers together, for their steps in flight (or pauses held) to end.
EXIT_STOP_S = 10.0
# The managers started in this process and not collected (a running one is held by its thread).
_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()


def stop_at_exit(manager: Any) -> None:
    """Stop `manager` at interpreter exit if it still runs then.

    Args:
        manager: a `ContinuousBatchingManager` whose engine thread just started.
    """
    _STARTED.add(manager)


@atexit.register
def _stop_started_managers() -> None:
    """Tell every running manager to stop, then wait for them together (at most `EXIT_STOP_S` in all)."""
    stopping = []
    for manager in [manager for manager in list(_STARTED) if manager.is_running()]:
        try:
            manager.stop(block=False)
            stopping.append(manager)
        except RuntimeError as error:  # its pause is still held here: nothing to wait for, say so in a line
            logger.warning("a running ContinuousBatchingManager was not stopped at exit: %s", error)
        except Exception:  # noqa: BLE001 - exiting: the next manager is still stopped
            logger.exception("could not stop a running ContinuousBatchingManager at exit")
    deadline = time.monotonic() + EXIT_STOP_S
    for manager in stopping:
        manager.join(timeout=max(deadline - time.monotonic(), 0.0))
        if manager.is_running():
            logger.warning(
                "a ContinuousBatchingManager still ran %g s after exit began (a pause held by another thread?)",
                EXIT_STOP_S,
            )

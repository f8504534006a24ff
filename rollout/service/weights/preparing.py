"""Making each update's staging area, off the serving thread, one update at a time.

A staging area is update-sized: a shared segment's pages are reserved (about 150 ms per GB) and, on a GPU worker,
page-locked, so making one takes seconds for a large model. The update's first job makes it (`prepare`), then
answers weights_ready once the transport is ready too (a torch.distributed group joined). One update prepares at a
time, so a client that begins and aborts in a loop makes one area at a time; an update that ended before its turn
makes none, and one that ended while making its area gives the area back before the next update makes its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollout import protocol as p
from rollout.service.weights.staged_update import StagedUpdate, UpdateRejected


class StagingPreparer:
    """Makes updates' staging areas one at a time and answers each one's weights_ready (or why not)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def prepare(self, update: StagedUpdate, report: Callable[[StagedUpdate, p.Message], None]) -> None:
        """Make `update`'s staging area and answer it: the update's first job, on its job thread (its buckets' and
        commit's jobs queue behind it, so a bucket sent before weights_ready still lands).

        Args:
            update: the update, open or ended meanwhile.
            report: from any thread, a reply that concludes a step of the update (the serving thread sends it).
                Passed per call, not kept: the slot that owns this preparer is freed without a garbage collection.
        """
        with self._lock:
            if update.ended:
                return  # rejected or aborted before its turn
            try:
                update.take_staging()
            except UpdateRejected as rejected:
                report(update, p.Error(rejected.code, str(rejected), rejected.field))
                return
            except Exception as error:  # noqa: BLE001 - e.g. a failed page-locked allocation: answered, never lost
                reason = f"cannot make the staging area: {type(error).__name__}: {error}"
                report(update, p.Error("internal", reason, "transport"))
                return
            if update.ended:
                update.close(clean=False)
                return
            ready = p.WeightsReady(update.update_id, update.staging_bytes, update.shm.name if update.shm else None)

            def joined(error: BaseException | None) -> None:  # on the transport's thread (a group's rendezvous)
                reply = ready if error is None else p.Error("bad_update", f"cannot join the group: {error}", "dist")
                report(update, reply)

            # Under the lock: a dead update's join, had it come after the live one's, would ask for its own group.
            if update.receiver.when_ready(update.begin, joined, cancelled=lambda: update.ended):
                report(update, ready)

"""Each client's replies that ZeroMQ did not take yet, in order, with their byte counts: the worker's memory for
clients that read slowly or not at all is bounded here.

A client's backlog may hold at most `max_pending_bytes`; all backlogs together at most `PENDING_TOTAL_FACTOR` times
that. A reply counts the memory it holds there, its Python objects' too (`frames_size`): a pong's 50 bytes take
about 200, and counting its bytes alone let a client that reads no pongs or deltas hold about four times its cap. Past the first, the client is dropped; past the second, the one whose backlog has gone longest without a reply
taken from it (by progress, not size: a large backlog read slowly outlives a small unread one). Who is dropped is
the caller's to handle (`on_over_cap`): it ends with `pop`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Collection

from rollout.service.zmq.large_replies import Encoding

# Unread replies all clients together may leave in the worker, as a multiple of the per-client cap: many sockets
# each under the cap must not exhaust the worker's memory.
PENDING_TOTAL_FACTOR = 4

Entry = list[bytes] | Encoding  # frames ready to send (routing id first), or a large reply still being encoded


# What a queued reply holds besides its frames' bytes (CPython's sizes): its list and its slot in the backlog's deque,
# and per frame its bytes object and its slot in the list.
REPLY_OVERHEAD = sys.getsizeof([]) + 8
FRAME_OVERHEAD = sys.getsizeof(b"") + 8


def frames_size(frames: list[bytes]) -> int:
    """Bytes of memory a queued reply's frames hold: their bytes, and the objects that hold them."""
    return REPLY_OVERHEAD + sum(len(frame) + FRAME_OVERHEAD for frame in frames)


class ReplyBacklogs:
    """Per-client backlogs of replies, bounded in bytes. Serving thread only (`total` is safe to read anywhere)."""

    def __init__(self, max_pending_bytes: int, on_over_cap: Callable[[bytes, str], None]):
        """
        Args:
            max_pending_bytes: most bytes of replies kept for one client.
            on_over_cap: called with (identity, reason) for a client dropped for its backlog; must `pop` it.
        """
        self.max_pending_bytes = max_pending_bytes
        self._on_over_cap = on_over_cap
        self._entries: dict[bytes, deque[Entry]] = {}
        self._bytes: dict[bytes, int] = {}
        self._progress_at: dict[bytes, float] = {}  # identity -> when its backlog began, or last had a reply taken
        self.total = 0
        self.peak = 0
        self.dropped_slow = 0

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._entries

    def get(self, identity: bytes) -> deque[Entry] | None:
        """The client's backlog (None: it has none)."""
        return self._entries.get(identity)

    def encoding(self, skip: Collection[bytes] = ()) -> bool:
        """A large reply is being encoded at the head of a backlog (of a client not in `skip`, whose replies wait).

        Args:
            skip: clients whose replies wait for now (`drain` leaves them alone: nothing to encode for them).
        """
        return any(
            backlog and isinstance(backlog[0], Encoding)
            for identity, backlog in self._entries.items()
            if identity not in skip
        )

    def open(self, identity: bytes) -> deque[Entry]:
        """The client's backlog, begun now (with its progress clock) if it has none."""
        backlog = self._entries.get(identity)
        if backlog is None:
            backlog = self._entries[identity] = deque()
            self._bytes[identity] = 0
            self._progress_at[identity] = time.monotonic()
        return backlog

    def queue(self, identity: bytes, frames: list[bytes]) -> None:
        """Keep `frames` at the end of the client's backlog, counted."""
        self.open(identity).append(frames)
        self.count(identity, frames_size(frames))

    def queue_encoding(self, identity: bytes, entry: Encoding) -> None:
        """Keep a large reply to encode at the end of the client's backlog; behind replies the client has not read
        it is counted now, by its estimate (at the head it is counted once encoded)."""
        backlog = self.open(identity)
        backlog.append(entry)
        if len(backlog) > 1:
            entry.counted = entry.estimated_bytes()
            self.count(identity, entry.counted)

    def count(self, identity: bytes, nbytes: int) -> None:
        """Add bytes now waiting in `identity`'s backlog to its count (negative: bytes that left it); past a cap, a
        client is dropped. A client without a backlog (dropped meanwhile) counts nothing."""
        if identity not in self._entries:
            return
        size = self._bytes.get(identity, 0) + nbytes
        self._bytes[identity] = size
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        if size > self.max_pending_bytes:
            self.dropped_slow += 1
            self._on_over_cap(identity, f"it left more than {self.max_pending_bytes} bytes of replies unread")
        cap = PENDING_TOTAL_FACTOR * self.max_pending_bytes
        while self.total > cap and self._bytes:
            stalest = self._stalest()
            reason = (
                f"all clients together left more than {cap} bytes of replies unread, and this one's have gone "
                "longest without a reply read"
            )
            self._on_over_cap(stalest, reason)
            if stalest in self._bytes:  # not dropped (lost already): the count is not this loop's to fix
                break
            self.dropped_slow += 1

    def _stalest(self) -> bytes:
        """The client holding unread replies whose backlog has gone longest without a reply taken from it (the
        largest backlog among equals)."""
        holding = [identity for identity, size in self._bytes.items() if size > 0] or list(self._bytes)
        return min(holding, key=lambda identity: (self._progress_at[identity], -self._bytes[identity]))

    def drain(self, send: Callable[[bytes, list[bytes]], bool], skip: Collection[bytes], ends: float | None) -> None:
        """Send what waits, oldest first per client, while `send` takes it; go on encoding large replies.

        Args:
            send: sends (identity, frames) now, or returns False (refused, or the client was lost by it).
            skip: clients whose replies wait for now.
            ends: `time.monotonic()` by which to stop encoding (None: finish every encoding).
        """
        for identity in list(self._entries):
            if identity in skip:
                continue
            backlog = self._entries.get(identity)
            while backlog and identity in self._entries:
                head = backlog[0]
                if isinstance(head, Encoding):
                    encoded = head.encoded(ends)
                    if encoded is None:  # this turn's encoding time is spent
                        break
                    self.count(identity, -head.counted)
                    head = backlog[0] = [identity, *encoded]
                    if not send(identity, head):  # refused: it waits like any reply, counted
                        self.count(identity, frames_size(head))  # (nothing when the send lost the client)
                        break
                    backlog.popleft()
                    self._progress_at[identity] = time.monotonic()
                    continue
                if not send(identity, head):
                    break
                backlog.popleft()
                self._progress_at[identity] = time.monotonic()
                self.count(identity, -frames_size(head))
            if not backlog and identity in self._entries:
                self.pop(identity)

    def pop(self, identity: bytes) -> deque[Entry]:
        """Forget the client's backlog, and return it (empty: it had none)."""
        self.total -= self._bytes.pop(identity, 0)
        self._progress_at.pop(identity, None)
        return self._entries.pop(identity, deque())

    def keep_encodings(self, identity: bytes, entries: deque[Entry]) -> None:
        """Give a client that fell silent back the large replies it was due, uncounted, to go out as they would
        have (results made before it fell silent)."""
        encodings = deque(entry for entry in entries if isinstance(entry, Encoding))
        if not encodings:
            return
        for entry in encodings:
            entry.counted = 0
        self._entries[identity], self._bytes[identity] = encodings, 0
        self._progress_at[identity] = time.monotonic()

    def close(self) -> None:
        """Forget every backlog and the caller's callback (which holds the caller: the two would otherwise wait for
        the garbage collector)."""
        self._entries.clear()
        self._bytes.clear()
        self._progress_at.clear()
        self.total = 0
        self._on_over_cap = _dropped_after_close


def _dropped_after_close(identity: bytes, reason: str) -> None:
    """What a closed ReplyBacklogs calls: nothing is kept after close, so nothing is over a cap."""

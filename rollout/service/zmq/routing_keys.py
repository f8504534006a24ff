"""Which CurveZMQ key holds each routing id. A client may choose its routing id, and once its connection closed
another key may connect with the same one, to which ZeroMQ then routes every reply. So with keys a routing id
belongs to the key that last spoke over it: a message over it with another key is a loss of the previous holder
(its groups and update end, its backlog is dropped), and a reply made for a key reaches the routing id only while
that key holds it.

Between a connection's close and the next message over its routing id, ZeroMQ would route replies to whoever
connects with that routing id next, before that peer has said a word (and so before its key is known). So a closed
connection's routing id is held (`hold`): replies made for a key wait, until a message shows which key speaks over
it now (the same key: they go out; another: its previous holder is lost, and they are dropped)."""

from __future__ import annotations

import time
from collections.abc import Iterable


class RoutingKeys:
    """The key each routing id last spoke with. Serving thread only."""

    def __init__(self, forget_after_s: float):
        """
        Args:
            forget_after_s: how long a routing id's key is kept after it last spoke while it has no groups in flight
                (longer than any reply made for its previous holder can wait to go out).
        """
        self.forget_after_s = forget_after_s
        self._keys: dict[bytes, tuple[str, float]] = {}  # identity -> (its key, when it last spoke)
        self.held: set[bytes] = set()  # routing ids whose connection closed since their key last spoke

    def claim(self, identity: bytes, key: str) -> bool:
        """`identity` spoke with `key`; True when another key held it (the routing id changed hands).

        Args:
            identity: the connection's routing id.
            key: its sender's CurveZMQ key (z85).
        """
        held = self._keys.get(identity)
        self._keys[identity] = (key, time.monotonic())
        self.held.discard(identity)
        return held is not None and held[0] != key

    def hold(self, identity: bytes) -> None:
        """`identity`'s connection closed: replies for its key wait until a message shows who speaks over it now.

        Args:
            identity: the connection's routing id (ignored when no key spoke over it).
        """
        if identity in self._keys:
            self.held.add(identity)

    def drop(self, identity: bytes) -> None:
        """Its holder was lost: nothing waits for it any more.

        Args:
            identity: the connection's routing id.
        """
        self.held.discard(identity)

    def holds(self, identity: bytes, key: str) -> bool:
        """True when a reply made for `key` may go to `identity` (its holder, or no key is known for it).

        Args:
            identity: the connection's routing id.
            key: the key the reply was made for.
        """
        return self._keys.get(identity, (key,))[0] == key

    def forget_idle(self, busy: Iterable[bytes]) -> None:
        """Forget the routing ids silent for `forget_after_s` that have no groups in flight.

        Args:
            busy: the routing ids with groups in flight.
        """
        now, busy = time.monotonic(), set(busy)
        for identity in [i for i, (_, when) in self._keys.items() if now - when > self.forget_after_s]:
            if identity not in busy:
                del self._keys[identity]
                self.held.discard(identity)

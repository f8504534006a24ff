"""What caller threads ask of the RolloutClient's I/O thread: one small dataclass per command, put in its mailbox
with a wake-up (`Dispatcher.command`), applied in order by the thread that owns the sockets."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from rollout import protocol as p
from trainer_bridge.client.calls import Call


@dataclass
class Submit:
    """Send a call's group to the least busy live worker (or park it until one answers)."""

    call: Call


@dataclass
class CancelCall:
    """Cancel a group: on its worker, or at once while it is parked. With `call`, only while the group in flight
    under this id is that call: a call refused as a duplicate id must not cancel the group that holds the id."""

    group_id: str
    call: Call | None = None


@dataclass
class OpenChannel:
    """Route every reply carrying `update_id` to `replies` (a weight update's channel)."""

    update_id: str
    replies: queue.SimpleQueue


@dataclass
class CloseChannel:
    """Stop routing a weight update's replies."""

    update_id: str


@dataclass
class SendRaw:
    """Send a message (and raw data frames) to one worker, by index."""

    worker: int
    message: p.Message
    data: Any = None


@dataclass
class AskStats:
    """Ask every live worker for its stats; `replies` first gets how many will answer, then each answer."""

    replies: queue.SimpleQueue


@dataclass
class AddWorker:
    """Connect to one more worker; `done` is set once it is in the client's list (or `error` says why not)."""

    address: str
    done: threading.Event
    error: str | None = None


@dataclass
class RemoveWorker:
    """Stop using a worker (its groups go to the others); `done` is set once it is retired."""

    address: str
    done: threading.Event


@dataclass
class AskVersions:
    """Ping every live worker now: the client's floor rose (`RolloutClient.min_policy_version`), and the calls it
    parks wait for a pong that shows a worker at the new version (else for the next heartbeat)."""


Command = AddWorker | RemoveWorker | Submit | CancelCall | OpenChannel | CloseChannel | SendRaw | AskStats | AskVersions

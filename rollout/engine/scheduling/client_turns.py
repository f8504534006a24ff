"""`ClientTurns`: the order of the waiting queue when several clients share an engine (`Request.client`: the worker
names each connection; in-process callers are all "").

Each new request gets a turn: one past its client's newest queued request, and at least one past the newest turn
admitted so far. The queue keeps new requests in turn order (arrival order among equal turns), behind the preempted
ones (at its head: their turns are never later than one admitted). So clients take turns: a client that queued a
thousand groups holds turns 1 to 1000, and another client's group, queued after them, gets turn 2 and waits for one
of them instead of a thousand. With one client every turn is one past the last: the queue is in arrival order, as
before clients took turns.

Invariant: `newest` holds only clients with requests waiting (admission and aborts forget the others), so a client
that cancelled a long queue starts again from the turn admitted, not behind its own cancelled requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rollout.engine.requests.request import Request


class ClientTurns:
    """Turns of the waiting requests per client (the scheduler's; torch-free)."""

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}  # client -> the turn of its newest waiting request
        self.admitted = 0  # the newest turn admitted so far

    def queue(self, waiting: deque[Request], request: Request) -> None:
        """Give a new request its turn and put it in `waiting` at that turn's place.

        Args:
            waiting: the scheduler's waiting queue (preempted requests at its head, then new ones by turn).
            request: the new request (`request.client` says whose).
        """
        turn = max(self.newest.get(request.client, 0), self.admitted) + 1
        self.newest[request.client] = request.turn = turn
        later = 0  # waiting requests with a later turn, all at the tail: with one client, none
        for queued in reversed(waiting):  # an iterator: indexing a deque's middle would make this quadratic
            if queued.turn <= turn:
                break
            later += 1
        if later:
            waiting.insert(len(waiting) - later, request)
        else:
            waiting.append(request)

    def took(self, request: Request) -> None:
        """A waiting request was admitted (or readmitted: its turn is an old one)."""
        self.admitted = max(self.admitted, request.turn)
        if self.newest.get(request.client, 0) <= request.turn:  # its client has nothing newer waiting
            self.newest.pop(request.client, None)

    def passed(self, waiting: Iterable[Request], request: Request) -> None:
        """The express lane admitted a waiting request past others of the queue (`waiting`, without it now). The turn
        new requests start from stays where it was: advanced to this request's, each short request of a client that
        sends them one after another would get a turn one place further back, until one lay past the waiting
        requests the lane looks at (`EXPRESS_SCAN`) and waited for a long group. Its client keeps the turn of its
        newest request still waiting, so that one client's queue stays in arrival order.

        Args:
            waiting: the scheduler's waiting queue, the admitted request out of it.
            request: the request the lane admitted.
        """
        self.forget(waiting, {request.client})

    def requeued(self, request: Request) -> None:
        """A running request went back to the head of the waiting queue (preempted, or reset by a weight update's
        "recompute" commit). Its turn becomes at most the newest admitted, as the queue's order needs (`queue` puts a
        new request behind every one whose turn is not later than its own): one the express lane admitted keeps a turn
        later than that (`passed`), and new requests would otherwise be put ahead of it, so that a short sample that
        had sampled tokens waited for a long group queued after it.

        Args:
            request: the request put back at the head of the waiting queue.
        """
        request.turn = min(request.turn, self.admitted)

    def forget(self, waiting: Iterable[Request], clients: set[str]) -> None:
        """After requests of `clients` left the waiting queue unadmitted (aborted): each keeps the turn of its
        newest request still waiting, or none."""
        newest: dict[str, int] = {}
        for request in waiting:
            if request.client in clients:
                newest[request.client] = max(newest.get(request.client, 0), request.turn)
        for client in clients:
            if client in newest:
                self.newest[client] = newest[client]
            else:
                self.newest.pop(client, None)

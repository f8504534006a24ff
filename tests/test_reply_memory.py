"""What the worker keeps for a client that does not read is bounded by the memory it holds, not by the bytes the
replies would take on the wire: a client leaving small replies unread (pongs, one-token deltas) held about four
times --max-pending-bytes of the worker's memory, each reply's Python objects outweighing its bytes."""

from __future__ import annotations

import tracemalloc

import pytest
import zmq

from rollout import protocol as p
from rollout.service.zmq.clients import ClientLinks

pytestmark = pytest.mark.timeout(60)
CAP = 1 << 20


@pytest.mark.parametrize(
    "reply", [p.Pong(123_456, 7), p.Delta("g", 0, [70_000], [-0.5], 3)], ids=lambda reply: reply.TYPE
)
def test_small_replies_left_unread_hold_at_most_the_cap_in_memory(reply):
    context = zmq.Context()
    context.set(zmq.BLOCKY, False)
    router = context.socket(zmq.ROUTER)
    lost: list[str] = []
    links = ClientLinks(router, max_pending_bytes=CAP, client_timeout_s=60, on_lost=lambda i, r: lost.append(r))
    router.setsockopt(zmq.SNDHWM, 1)  # (after ClientLinks, which sets its own): the replies wait in the backlog
    router.setsockopt(zmq.SNDBUF, 4096)
    router.bind("tcp://127.0.0.1:*")
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    tracemalloc.start()
    try:
        peer.send_multipart(p.encode(p.Ping(1)))
        identity = router.recv_multipart()[0]
        links.seen(identity)
        before, held = tracemalloc.get_traced_memory()[0], 0
        for _ in range(200_000):
            links.send(identity, reply)
            if lost:
                break
            held = max(held, tracemalloc.get_traced_memory()[0] - before)
        assert lost and "unread" in lost[0], f"200,000 replies kept ({held:,} bytes)"
        assert links.pending_bytes() == 0
        # The replies' memory, not their wire bytes: a few per cent over the cap (what the backlog's deque and the
        # last reply add), not four times it.
        assert held <= 1.1 * CAP, f"{held:,} bytes held for a client capped at {CAP:,}"
    finally:
        tracemalloc.stop()
        links.close()
        peer.close(linger=0)
        router.close(linger=0)
        context.term()

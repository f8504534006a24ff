"""With CurveZMQ keys, a client whose connection closed has its routing id held (routing_keys.py): its replies wait
for the next message over that id. A large group result waiting so is not work the serving loop can do: its
`encoding` must not keep the loop polling without a wait (a busy spin that took the GIL from the engine, for every
client, until the routing id was forgotten five minutes later)."""

from __future__ import annotations

import time

import pytest
import zmq
from test_stepwise_replies import big_result

from rollout import protocol as p
from rollout.protocol.sockets import frame_fd
from rollout.service.zmq.clients import ClientLinks

pytestmark = pytest.mark.timeout(60)


def test_a_large_result_for_a_held_routing_id_leaves_the_loop_idle():
    context = zmq.Context()
    context.set(zmq.BLOCKY, False)
    router = context.socket(zmq.ROUTER)
    lost: list[bytes] = []
    links = ClientLinks(router, max_pending_bytes=1 << 30, client_timeout_s=60, on_lost=lambda i, r: lost.append(i))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.ROUTING_ID, b"trainer")
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        peer.send_multipart(p.encode(p.Ping(1)))
        assert router.poll(10_000), "no message"
        frames = router.recv_multipart(copy=False)
        links.seen(frames[0].bytes, frame_fd(frames[1]), "key-1")
        peer.close()  # its group finished as it left: its result is made after the close
        assert links.monitor.poll(10_000), "no disconnect event"
        links.on_monitor_events()
        links.send(b"trainer", big_result(), key="key-1")  # held: it waits for the routing id's next message
        deadline = time.monotonic() + 5
        while links.encoding and time.monotonic() < deadline:
            links.flush()
            links.watch([], p.Pong(p.PROBE_NONCE, 0))
        assert not links.encoding, "the serving loop would poll without waiting while the routing id is held"
        assert not lost
    finally:
        links.close()
        router.close(linger=0)
        context.term()

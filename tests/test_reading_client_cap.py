"""A client that reads its replies is never dropped as over --max-pending-bytes at its default for results the worker
may legitimately make: a GRPO step of 128 groups of 16 samples of 2,048 tokens that end together (each over
STEPWISE_TOKENS: encoded in turns) waits in the backlog behind the first result being encoded, or behind streamed
deltas ZeroMQ's queue could not take yet, while the client reads on. Counted at 80 bytes a token (the Python objects
of a result not encoded yet), they counted 333 MB, past the 256 MiB default, and the trainer was dropped with its
groups cancelled; on the wire they take about 59 MB."""

from __future__ import annotations

import pytest
import zmq

from rollout.protocol import messages as p
from rollout.protocol.codec import decode, encode
from rollout.service.zmq.clients import ClientLinks
from rollout.service.zmq.limits import WorkerLimits
from rollout.service.zmq.router_options import SEND_HWM, configure_router

pytestmark = pytest.mark.timeout(120)


def _result(group_id: str, samples: int = 16, tokens: int = 2048) -> p.GroupResult:
    token_ids, logprobs = [1000 + i for i in range(tokens)], [-0.25] * tokens  # shared: little memory for the test
    completions = [p.Completion(i, token_ids, logprobs, "length") for i in range(samples)]
    return p.GroupResult(group_id, [1, 2, 3], completions)


@pytest.mark.parametrize("ahead", ["deltas", "result"])
def test_a_reading_client_is_not_dropped_for_a_large_result_queued_behind_others(ahead):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    configure_router(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    lost: list[str] = []
    cap = WorkerLimits().max_pending_bytes
    links = ClientLinks(router, max_pending_bytes=cap, client_timeout_s=60, on_lost=lambda i, r: lost.append(r))
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"trainer")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart(encode(p.Ping(1)))
        assert router.poll(5000)
        identity = router.recv_multipart()[0]
        links.seen(identity)
        expected = 0
        if ahead == "deltas":  # one step of streamed samples: past ZeroMQ's queue of SEND_HWM
            for index in range(SEND_HWM + 100):
                links.send(identity, p.Delta(f"g{index % 128}", index % 16, [5], [-0.5], 0))
            expected += SEND_HWM + 100
        for group in range(128):  # a step's groups that ended together: each waits while those before are encoded
            links.send(identity, _result(f"g{group}"))
        expected += 128
        assert not lost, lost
        got = 0
        while got < expected and not lost:
            links.flush(encode_s=0.05)
            while dealer.poll(10):
                decode(dealer.recv_multipart())
                got += 1
        assert not lost, lost
        assert got == expected and links.pending_bytes() == 0
    finally:
        links.close()
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()

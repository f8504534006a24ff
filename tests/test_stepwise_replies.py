"""A large group result is encoded in steps, a few milliseconds per turn of the serving loop, in its client's place
in the backlog: other clients' replies go out meanwhile, the same client's later replies wait behind it, and the
frames are byte for byte those of `encode` (a result of 1,024 samples of 2,047 tokens took about 190 ms to encode in
one call, a stall for every other client)."""

from __future__ import annotations

import random

import pytest
import zmq

from rollout.protocol import messages as p
from rollout.protocol.codec import decode, encode, encode_steps
from rollout.service.zmq.clients import ClientLinks
from rollout.service.zmq.large_replies import STEPWISE_TOKENS


def big_result(group_id: str = "big", samples: int = 16) -> p.GroupResult:
    rng = random.Random(0)
    tokens = STEPWISE_TOKENS // samples + 1
    completions = [
        p.Completion(
            i,
            [rng.randrange(150_000) for _ in range(tokens)],
            [-rng.random() * 5 for _ in range(tokens)],
            "length",
            error=None if i % 2 else "x",
            policy_versions=[[0, 0], [1, 7]],
        )
        for i in range(samples)
    ]
    return p.GroupResult(group_id, [1, 2, 3], completions)


def run_steps(steps):
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, count
        count += 1


@pytest.mark.parametrize(
    "message",
    [
        big_result(),
        p.GroupResult("g", [1], []),
        p.Pong(3, 4),
        p.Error("busy", "x", None, "g"),
        p.HelloReply("m", 9, 64, 2, {"block_size": 16}),
    ],
    ids=lambda message: message.TYPE,
)
def test_encoding_in_steps_gives_the_frames_of_encode(message):
    frames, steps = run_steps(encode_steps(message))
    assert frames == encode(message)
    assert steps == (len(message.completions) if isinstance(message, p.GroupResult) else 0)
    assert decode(frames) == message


@pytest.fixture
def links(request):
    """ClientLinks over a worker's ROUTER socket (its byte limit the test's indirect parameter, else 1 GiB), with two
    DEALER clients that said hello; "slow" takes little before ZeroMQ refuses more (small queues and buffers)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    lost: list[bytes] = []
    limit = getattr(request, "param", 1 << 30)
    links = ClientLinks(router, max_pending_bytes=limit, client_timeout_s=30, on_lost=lambda i, _: lost.append(i))
    router.setsockopt(zmq.SNDHWM, 4)
    clients = {}
    for name in (b"slow", b"other"):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, name)
        if name == b"slow":
            dealer.setsockopt(zmq.RCVHWM, 4)
            dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.poll(5000) and router.recv_multipart()[0] == name
        clients[name] = dealer
    yield links, clients, lost
    links.close()
    for dealer in clients.values():
        dealer.close(linger=0)
    router.close(linger=0)
    context.term()


def received(dealer: zmq.Socket) -> list:
    """The messages that reached `dealer` so far."""
    messages = []
    while dealer.poll(200):
        messages.append(decode(dealer.recv_multipart()))
    return messages


def test_a_large_result_waits_in_its_clients_place_while_others_are_served(links):
    links, clients, lost = links
    result = big_result()
    links.send(b"slow", result)
    links.send(b"slow", p.Pong(1, 0))  # after the result: must not overtake it
    links.send(b"other", p.Pong(2, 0))  # another client: not held back
    assert links.encoding
    links.flush(encode_s=0.0)  # a turn whose encoding budget is spent: one step at most
    assert links.encoding and received(clients[b"other"]) == [p.Pong(2, 0)] and received(clients[b"slow"]) == []
    turns = 1
    while links.encoding:
        links.flush(encode_s=0.0)
        turns += 1
    links.flush()
    assert turns > 1 and received(clients[b"slow"]) == [result, p.Pong(1, 0)]
    assert links.pending_bytes() == 0 and not lost


def test_a_result_that_cannot_be_encoded_is_answered_with_an_internal_error(links):
    links, clients, _ = links
    result = big_result("broken")
    result.completions[3].error = object()  # not a wire value
    links.send(b"slow", result)
    links.flush(encode_s=None)
    [reply] = received(clients[b"slow"])
    assert isinstance(reply, p.Error) and reply.code == "internal" and reply.group_id == "broken"
    assert not links.encoding


def test_a_client_lost_while_its_result_encodes_leaves_nothing_behind(links):
    links, clients, lost = links
    links.send(b"slow", big_result())
    links.flush(encode_s=0.0)
    links.lose(b"slow", "test", unreachable=True)
    assert lost == [b"slow"] and not links.encoding and links.pending_bytes() == 0
    links.flush(encode_s=None)
    assert received(clients[b"slow"]) == []


PAD = p.Error("busy", "x" * 60_000, None, "g")


def refused_once(links) -> int:
    """Send "slow" replies it does not read until ZeroMQ refuses one (it waits in the backlog); how many were sent."""
    for sent in range(1, 5_000):
        links.send(b"slow", PAD)
        if links._backlogs.get(b"slow"):
            return sent
    raise AssertionError("ZeroMQ took every reply")


def test_a_result_behind_a_refused_reply_waits_without_spinning_and_follows_it(links):
    """Nothing can be sent to a client that does not read, so nothing is encoded for it meanwhile and the loop may
    wait for messages (`encoding` False: `serve` polled without waiting, taking the GIL from the engine); once it
    reads, the refused replies and then the result arrive, in order."""
    links, clients, lost = links
    sent = refused_once(links)
    result = big_result()
    links.send(b"slow", result)
    for _ in range(50):
        links.flush()
    assert not links.encoding and not lost
    arrived = []
    while len(arrived) < sent + 1:
        assert clients[b"slow"].poll(5000), f"{len(arrived)} of {sent + 1} replies arrived"
        arrived.append(decode(clients[b"slow"].recv_multipart()))
        links.flush(encode_s=None)
    assert arrived == [PAD] * sent + [result] and links.pending_bytes() == 0


@pytest.mark.parametrize("links", [150_000], indirect=True)
def test_a_result_larger_than_the_byte_limit_reaches_a_client_that_reads(links):
    """The limit is on bytes a client leaves unread: a result ZeroMQ takes at once never counts against it (it was
    counted while encoded, and the client dropped)."""
    links, clients, lost = links
    result = big_result("other")
    assert sum(map(len, encode(result))) > 150_000
    links.send(b"other", result)
    while links.encoding:
        links.flush()
    assert received(clients[b"other"]) == [result] and not lost and links.pending_bytes() == 0


@pytest.mark.parametrize("links", [1_000_000], indirect=True)
def test_results_queued_behind_unread_replies_count_against_the_limit(links):
    """Results behind replies a client has not read count (an estimate until encoded): past the limit the client
    is lost, its backlog dropped (they did not count: memory grew without bound)."""
    links, _, lost = links
    refused_once(links)
    for _ in range(10):
        links.send(b"slow", big_result())
        links.flush()
    assert lost == [b"slow"] and links.pending_bytes() == 0 and not links.encoding


def test_a_silent_clients_result_still_encoding_is_sent(links):
    """A client silent past its timeout is lost (its groups cancelled) but still reachable: the results made before
    go out as they would have had they been encoded at once."""
    links, clients, lost = links
    result = big_result("other")
    links.send(b"other", result)
    links.flush(encode_s=0.0)
    links.lose(b"other", "silent", unreachable=False)
    while links.encoding:
        links.flush()
    assert lost == [b"other"] and received(clients[b"other"]) == [result] and links.pending_bytes() == 0


def test_large_results_with_prompt_log_probs_wait_behind_each_other(links):
    """Results whose completions name prompt log-prob frames (`SampleArrays`), queued behind one another, are counted
    by their frames: the estimate took their length as a list's, and the worker's serving loop ended (TypeError)."""
    links, clients, lost = links
    results = [big_result(f"scored{index}") for index in range(2)]
    for result in results:
        result.data_frames = [bytes(4 * 3), bytes(4 * 3)]
        for completion in result.completions:  # the group's prompt arrays, named by every completion
            completion.prompt_logprobs = p.FrameArray(0, [3], "float32")
            completion.prompt_logprob_ranks = p.FrameArray(1, [3], "int32")
        links.send(b"slow", result)
    while links.encoding:
        links.flush(encode_s=0.0)
    links.flush()
    assert [message.group_id for message in received(clients[b"slow"])] == ["scored0", "scored1"] and not lost

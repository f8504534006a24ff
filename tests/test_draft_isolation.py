"""Speculative decoding's drafts stay with the client that made them, on a real `rollout-worker --speculative suffix`.
A review found that a client's drafts outlived its connection, keyed by its routing id alone: ZeroMQ lets a client
choose its routing id (and libzmq's own are a predictable counter), so a connection that took over a gone client's id
drew on its completions (an oracle through the stats' accepted drafts, or step times). Drafts are now keyed by the
connection and the session secret every `RolloutClient` draws (`Generate.session`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq
from test_speculative import MODEL, TOKENIZER

from rollout import protocol as p
from service_helpers import Worker

pytestmark = pytest.mark.timeout(180)

PROMPT = [901, 17, 333, 512, 64, 7, 250, 8]
SAMPLING = dict(temperature=1.0, seed=123, stop_token_ids=[], max_new_tokens=48)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    directory = tmp_path_factory.mktemp("low-entropy")
    MODEL.save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    server = Worker("--model", str(directory), "--num-blocks", "256", "--block-size", "8", "--speculative", "suffix")
    yield server
    server.close()


@contextlib.contextmanager
def dealer(address: str, identity: bytes) -> Iterator[zmq.Socket]:
    """A DEALER presenting `identity` (one connection: a closed one's id may still be taken for a moment)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)


def ask(sock: zmq.Socket, message: p.Message, answer: type) -> p.Message:
    """Send `message`; its first reply of type `answer`."""
    sock.send_multipart(p.encode(message))
    deadline = time.monotonic() + 60
    while sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
        reply = p.decode(sock.recv_multipart())
        if isinstance(reply, (answer, p.Error)):
            assert isinstance(reply, answer), reply
            return reply
    raise TimeoutError(f"no {answer.__name__} within 60 s")


def accepted_drafts(address: str, reader: str) -> int:
    with dealer(address, f"stats-{reader}".encode()) as sock:  # each read over an id of its own
        return ask(sock, p.Stats(), p.StatsReply).stats["accepted_draft_tokens"]


class RecordingManager:
    """Stands for the engine's manager behind a `GroupDesk`: records the groups handed to it, which never end."""

    def __init__(self):
        self.specs = []

    def add_groups(self, specs):
        self.specs += specs

    def register_result_handler(self, group_id, handler):
        pass


def test_a_connection_taking_over_a_gone_clients_id_draws_on_none_of_its_drafts(worker):
    """Groups of one routing id, as a client and then an intruder that took its id over would send them (one
    connection here: to the worker, a reconnection presenting the same id is the same client)."""
    counts = {}
    with dealer(worker.address, b"\x01taken-over-id") as taken:  # guessed (libzmq's ids are a counter) or chosen
        groups = [("owner", "own"), ("owner-again", "own"), ("intruder", "other"), ("no-session", "")]
        for group, session in [*groups, ("no-session-again", "")]:
            before = accepted_drafts(worker.address, f"{group}-before")
            ask(taken, p.Generate(group, PROMPT, 1, SAMPLING, session=session), p.GroupResult)
            counts[group] = accepted_drafts(worker.address, f"{group}-after") - before
        refused = ask(taken, p.Generate("long", PROMPT, 1, SAMPLING, session="x" * 65), p.Error)
    # The owner's second group draws on its first (the comparison can fail); another session over the same id draws
    # only on its own sample's tokens, as the owner's first group did.
    assert counts["owner-again"] >= 20, counts
    assert max(counts["intruder"], counts["no-session"]) < counts["owner-again"] / 4, counts
    # A group with no session shares drafts with no other group: a client that sends none (not a RolloutClient) is
    # not drawn on by a later connection that took its id over and sends none either (it was).
    assert counts["no-session-again"] < counts["owner-again"] / 4, counts
    assert refused.field == "session" and "64 characters" in refused.message


def test_sessions_of_one_connection_share_its_admission_turns():
    """The session keys drafts only: a connection sending a new session with each group is still one client when
    admission takes turns (else a flood of groups, each its own "client", would all go ahead of another client's)."""
    from rollout.service.group_counters import GroupCounters
    from rollout.service.observability.tracing import Tracer
    from rollout.service.zmq.group_desk import GroupDesk
    from rollout.service.zmq.limits import WorkerLimits

    manager = RecordingManager()
    desk = GroupDesk(manager, WorkerLimits(), GroupCounters(), Tracer(), lambda: None, compiles=None)
    for index in range(3):
        message = p.Generate(f"g{index}", PROMPT, 1, SAMPLING, session=f"session-{index}")
        desk.generate(b"\x01one-connection", message, lambda identity, reply: None)
    assert {spec.client for spec in manager.specs} == {b"\x01one-connection".hex()}
    assert [spec.session for spec in manager.specs] == ["session-0", "session-1", "session-2"]


def test_with_keys_a_key_is_one_client_however_many_connections_it_opens():
    """With CurveZMQ keys, the key is the client: a trainer's connections share its admission turns and its
    --max-groups-per-client (a key holder opening a thousand connections no longer takes a thousand turns); without
    keys, each connection is a client."""
    from rollout.service.group_counters import GroupCounters
    from rollout.service.observability.tracing import Tracer
    from rollout.service.zmq.group_desk import GroupDesk
    from rollout.service.zmq.limits import WorkerLimits

    manager, replies = RecordingManager(), []
    desk = GroupDesk(manager, WorkerLimits(max_groups_per_client=2), GroupCounters(), Tracer(), lambda: None, None)
    answer = lambda identity, reply: replies.append((identity, reply))  # noqa: E731
    sent = [(b"\x01first", "trainer-key"), (b"\x01second", "trainer-key"), (b"\x01third", "trainer-key")]
    sent += [(b"\x01fourth", "other-key"), (b"\x01fifth", None), (b"\x01sixth", None)]
    for index, (connection, key) in enumerate(sent):
        desk.generate(connection, p.Generate(f"g{index}", PROMPT, 1, SAMPLING), answer, key)
    ((refused_to, refusal),) = replies  # the third connection of the key: its two groups are in flight
    assert refused_to == b"\x01third" and refusal.code == "busy" and "--max-groups-per-client" in refusal.message
    clients = [spec.client for spec in manager.specs]
    assert clients[:2] == ["key:trainer-key"] * 2 and clients[2] == "key:other-key"
    assert clients[3:] == [b"\x01fifth".hex(), b"\x01sixth".hex()]

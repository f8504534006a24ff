"""A real `rollout-worker` subprocess on CPU, spoken to over loopback with raw DEALER sockets and the protocol
codec: results equal the in-process engine's, streams reassemble, cancel and bad input are answered, a vanished
client's blocks are freed, backpressure says busy, and SIGTERM aborts in-flight groups and tells their clients."""

from __future__ import annotations

import signal
import time

import msgpack
import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout import protocol as p
from rollout.presets import tiny_model
from service_helpers import TIMEOUT_S, Client, Worker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def worker():
    server = Worker()
    yield server
    server.close()


@pytest.fixture
def client(worker):
    connection = Client(worker.address)
    yield connection
    connection.close()


GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 12}


def test_hello_describes_the_model(client):
    reply = client.ask(p.Hello())
    assert (reply.model, reply.vocab_size, reply.max_model_len, reply.policy_version) == ("tiny", 1024, 2048, 0)
    assert reply.config["block_size"] == 16


def test_group_of_eight_equals_in_process_engine(client):
    """A greedy group of n=8 with logprobs through the socket equals the in-process engine on the same preset."""
    prompt = list(range(5, 45))
    result = client.ask(p.Generate("g8", prompt, n=8, sampling=GREEDY))
    expected = generate_batch(
        tiny_model(),
        [prompt],
        progress_bar=False,
        n=8,
        sampling=SamplingParams(**GREEDY),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, block_size=16),
    )
    assert isinstance(result, p.GroupResult) and result.prompt_ids == prompt
    assert [c.sample_index for c in result.completions] == list(range(8))
    for completion in result.completions:
        local = expected[f"req_0#{completion.sample_index}"]
        assert completion.token_ids == local.generated_tokens
        assert completion.logprobs == pytest.approx(local.logprobs, abs=1e-5)
        assert (completion.finish_reason, completion.policy_versions) == ("length", [[0, 0]])


def test_stream_reassembles_to_the_result(client):
    sampling = {"temperature": 1.0, "seed": 5, "stop_token_ids": [], "max_new_tokens": 9}
    client.send(p.Generate("s", [3, 1, 4, 1, 5], n=3, sampling=sampling, stream=True))
    deltas, result = client.until_result("s")
    for completion in result.completions:
        mine = [d for d in deltas if d.sample_index == completion.sample_index]
        assert [t for d in mine for t in d.token_ids] == completion.token_ids
        assert [x for d in mine for x in d.logprobs] == completion.logprobs
        assert all(len(d.token_ids) == 1 for d in mine)  # deltas, not cumulative copies


def test_cancel_mid_stream_returns_partial_output(client):
    sampling = {**GREEDY, "max_new_tokens": 1500}
    client.send(p.Generate("long", [1, 2, 3], n=2, sampling=sampling, stream=True))
    assert isinstance(client.receive(), p.Delta)
    client.send(p.Cancel("long"))
    deltas, result = client.until_result("long")
    assert [c.finish_reason for c in result.completions] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 1500 for c in result.completions)
    assert isinstance(client.ask(p.Cancel("long")), p.Error)  # no longer in flight: unknown_group


@pytest.mark.parametrize(
    "frames, field",
    [
        ([b"\x00\xff"], "header"),
        ([msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": "generate", "group_id": "x"})], "prompt_ids"),
        (p.encode(p.Generate("x", [1, 2], n=0)), "n"),
        (p.encode(p.Generate("x", [1, 5000])), "prompt_ids"),
        (p.encode(p.Generate("x", [])), "prompt_ids"),
        (p.encode(p.Generate("x", [1], sampling={"top_p": 2.0})), "sampling.top_p"),
        (p.encode(p.Generate("x", [1], sampling={"max_new_tokens": 5000})), "sampling.max_new_tokens"),
        (p.encode(p.Generate("x", [1], sampling={"nope": 1})), "sampling.nope"),
        (p.encode(p.Generate("x", [1, 2], sampling={"prompt_logprobs": -1})), "sampling.prompt_logprobs"),
        (p.encode(p.Generate("x", [1, 2], sampling={"return_routes": True})), "sampling.return_routes"),  # dense
        (p.encode(p.Generate("x", [1, 2], sampling={"return_routes": 1})), "sampling.return_routes"),
        (p.encode(p.Generate("x#1", [1])), "group_id"),
        (p.encode(p.Pong(1, 0)), "type"),
    ],
)
def test_bad_input_gets_an_error_naming_the_field(client, frames, field):
    """Refused by name, and a refused generate request is counted in groups_refused whichever check refused it
    (one over a decoding limit, such as a prompt past the context, had not been)."""
    refused_before = client.ask(p.Stats()).stats["groups_refused"]
    client.socket.send_multipart(frames)
    reply = client.receive()
    assert isinstance(reply, p.Error) and reply.field == field and reply.code == "bad_request", reply
    if field == "group_id":  # named as the client sent it, not as the id the worker makes of it (connection/id)
        assert reply.message == "group_id: must not hold '#' (the ids of a group's samples use it)"
    assert isinstance(client.ask(p.Ping(9)), p.Pong)
    generate = b"generate" in frames[0]
    assert client.ask(p.Stats()).stats["groups_refused"] == refused_before + generate


def test_fuzzed_messages_all_get_replies_and_worker_keeps_serving(client):
    """Hundreds of malformed or mistyped messages each get exactly one error reply; then a normal group works."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    values = (
        st.none()
        | st.booleans()
        | st.integers(-5, 5000)
        | st.text(max_size=4)
        | st.lists(st.integers(-5, 5000) | st.text(max_size=2), max_size=4)
        | st.dictionaries(st.text(max_size=6), st.integers(-5, 5000))
    )
    count = {"n": 0}

    @settings(max_examples=500, deadline=None, database=None)  # tests/test_fuzz.py sends 3,000 more
    @given(
        kind=st.sampled_from(["generate", "cancel", "ping", "hello", "stats", "delta", "x"]),
        fields=st.dictionaries(
            st.sampled_from(["group_id", "prompt_ids", "n", "sampling", "stream", "nonce"]), values, max_size=5
        ),
        raw=st.binary(max_size=12),
    )
    def one(kind, fields, raw):
        frames = [raw] if kind == "x" else [msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": kind, **fields})]
        client.socket.send_multipart(frames)
        reply = client.receive()
        count["n"] += 1
        if isinstance(reply, (p.Pong, p.HelloReply, p.StatsReply)):
            return
        if isinstance(reply, p.Error):
            return
        # A well-formed generate was accepted: wait for its result so groups do not pile up.
        while not isinstance(reply, p.GroupResult):
            reply = client.receive()

    one()
    assert count["n"] >= 500
    result = client.ask(p.Generate("after-fuzz", [7, 8, 9], sampling=GREEDY))
    assert isinstance(result, p.GroupResult) and len(result.completions[0].token_ids) == 12


def test_vanished_client_frees_its_blocks(worker):
    """A client that disconnects mid-stream has its groups cancelled; the worker's KV blocks all come back."""
    doomed = Client(worker.address)
    doomed.send(p.Generate("gone", list(range(100)), n=4, sampling={**GREEDY, "max_new_tokens": 1500}, stream=True))
    assert isinstance(doomed.receive(), p.Delta)
    doomed.close()
    observer = Client(worker.address)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            stats = observer.ask(p.Stats()).stats
            if stats["groups_in_flight"] == 0 and stats["kv_blocks_used"] == 0:
                break
            time.sleep(0.1)
        assert stats["groups_in_flight"] == 0 and stats["kv_blocks_used"] == 0, stats
    finally:
        observer.close()


def test_busy_and_sigterm():
    """With max_queue_size=1 and one sequence at a time, extra groups are refused with "busy" at once; SIGTERM then
    ends the accepted groups with "abort", tells their client, and the worker exits cleanly."""
    server = Worker("--max-queue-size", "1", "--max-num-seqs", "1")
    client = Client(server.address)
    try:
        for index in range(4):
            client.send(p.Generate(f"q{index}", [1, 2, 3], sampling={**GREEDY, "max_new_tokens": 2000}))
        # The worker answers a connection's messages in order: every refusal comes before the stats reply, and the
        # accepted groups stay silent until they end (no fixed wait that a loaded machine could outrun).
        client.send(p.Stats())
        busy = []
        while not isinstance(reply := client.receive(), p.StatsReply):
            assert isinstance(reply, p.Error) and reply.code == "busy", reply
            busy.append(reply.group_id)
        accepted = sorted({f"q{i}" for i in range(4)} - set(busy))
        assert busy and accepted  # at most one waits in the queue; the rest are refused at once
        server.process.send_signal(signal.SIGTERM)
        results = [client.receive() for _ in accepted]
        assert sorted(r.group_id for r in results) == accepted
        assert all(r.completions[0].finish_reason == "abort" for r in results)
        assert server.process.wait(TIMEOUT_S) == 0
    finally:
        client.close()
        server.close()


def test_duplicate_group_id_while_running_is_refused(client, worker):
    """A second generate with the id of a group still running gets duplicate_group; another client may use the
    same id (ids are per client); the first group still completes."""
    client.send(p.Generate("dup", [1, 2, 3], sampling={**GREEDY, "max_new_tokens": 300}))
    reply = client.ask(p.Generate("dup", [4, 5, 6], sampling=GREEDY))
    assert isinstance(reply, p.Error) and (reply.code, reply.field, reply.group_id) == (
        "duplicate_group",
        "group_id",
        "dup",
    )
    other = Client(worker.address)
    try:
        assert isinstance(other.ask(p.Generate("dup", [4, 5, 6], sampling=GREEDY)), p.GroupResult)
    finally:
        other.close()
    _, result = client.until_result("dup")
    assert len(result.completions[0].token_ids) == 300


def test_slow_reader_loses_nothing(worker):
    """A client that reads nothing until its streaming groups are done (thousands of deltas queued) still gets every
    delta and every result. (At this size the kernel's socket buffers absorb the backlog, so this does not by itself
    reproduce a full ZeroMQ send queue; the worker disables the send high-water mark so none can drop results.)"""
    # As RolloutClient's sockets: no receive high-water mark, so the reader's ZeroMQ keeps reading however far its
    # application falls behind. A raw socket left at the default stops reading at 1,000 messages, and the worker then
    # rightly drops it once its unread replies pass the byte cap (max_pending_bytes).
    reader = Client(worker.address, receive_hwm=0)
    observer = Client(worker.address)
    try:
        for index in range(4):
            reader.send(
                p.Generate(f"slow{index}", [index, 1, 2], n=4, sampling={**GREEDY, "max_new_tokens": 300}, stream=True)
            )
        deadline = time.monotonic() + 120
        time.sleep(0.5)
        while observer.ask(p.Stats()).stats["groups_in_flight"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        results, tokens = {}, 0
        while len(results) < 4:
            reply = reader.receive()
            if isinstance(reply, p.Delta):
                tokens += len(reply.token_ids)
            else:
                assert isinstance(reply, p.GroupResult), reply
                results[reply.group_id] = reply
        assert tokens == 4 * 4 * 300
        assert all(c.finish_reason == "length" for r in results.values() for c in r.completions)
    finally:
        reader.close()
        observer.close()


@pytest.mark.parametrize("kind", [[], {}, [1, [2]], {"a": 1}])
def test_an_unhashable_message_type_gets_an_error_and_the_worker_keeps_serving(client, kind):
    """The 17-byte message of issue 14 (a header whose `type` is a list or a map) ended `serve()`: it must get an
    error reply naming the field, and the worker must go on answering."""
    client.socket.send_multipart([msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": kind})])
    reply = client.receive()
    assert isinstance(reply, p.Error) and (reply.code, reply.field) == ("bad_request", "type")
    assert isinstance(client.ask(p.Ping(7)), p.Pong)


def test_data_frames_after_a_message_without_data_are_refused(client):
    client.socket.send_multipart([*p.encode(p.Ping(3)), b"unexpected bytes"])
    reply = client.receive()
    assert isinstance(reply, p.Error) and reply.field == "frames"
    assert isinstance(client.ask(p.Ping(4)), p.Pong)


@pytest.mark.parametrize("version", [2**64 - 1, 2**63])
def test_a_version_beyond_int64_is_refused_at_begin(client, version):
    """A version near 2**64 was accepted and the next update's reply could not be encoded, ending the worker."""
    spec = p.TensorSpec("model.norm.weight", "float32", [256])
    reply = client.ask(p.WeightsBegin("huge", [spec], version=version, partial=True))
    assert isinstance(reply, p.Error) and reply.field == "version" and "int64" in reply.message
    assert client.ask(p.Hello()).policy_version == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bind", "127.0.0.1:5630"], "is not a ZeroMQ address"),
        (["--bind", "tcp://127.0.0.1"], "has no port"),
        (["--num-blocks", "0"], "--num-blocks: 0 is invalid"),
        (["--model", "/nonexistent/model"], "no such model directory"),
        (["--device", "bogus"], "--device bogus: not a device rollout runs on; give cpu, cuda or cuda:N"),
        (["--api-key", "k"], "--api-key protects the HTTP API"),
        (["--http", "8000"], "expected HOST:PORT"),
        (["--http", "0.0.0.0:8000"], "needs --api-key"),
        (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer /nonexistent/tokenizer"),
        pytest.param(
            ["--gpu", "0"],
            "sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA"),
        ),
    ],
)
def test_ordinary_mistakes_are_one_line_usage_errors(flags, message, capsys):
    """rollout-worker answers a malformed address, a bad setting, a missing model directory or a CUDA flag on a
    CPU-only torch with a usage error (exit 2), before loading any model."""
    from rollout.service.launch import cli

    bind = [] if "--bind" in flags else ["--bind", "tcp://127.0.0.1:*"]  # the default port may be taken here
    with pytest.raises(SystemExit) as stop:
        cli.main([*flags, *bind])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_hub_model_on_a_machine_without_network_is_one_line_at_once(capsys, monkeypatch, tmp_path):
    """A hub id neither reachable nor cached: one usage line saying what to do, not a minute of retries."""
    from huggingface_hub import constants

    from rollout.service.launch import cli

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        cli.main(["--model", "someone/some-model", "--bind", "tcp://127.0.0.1:*"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --model someone/some-model: not a local path, 127.0.0.1 cannot be reached" in err
    assert "hf download someone/some-model" in err and "Traceback" not in err


def test_an_unreachable_hub_is_waited_for_once_per_command(capsys, monkeypatch, tmp_path):
    """`--max-prompt-len` reads the model's config before loading, and loading checks the hub again: a hub that did
    not answer is not probed (and waited for) a second time."""
    import socket

    from huggingface_hub import constants

    from rollout.cli import hub
    from rollout.service.launch import cli

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_unreachable_since", {})
    probes = []

    def refused(address, timeout=None):
        probes.append(address)
        raise ConnectionRefusedError(address)

    monkeypatch.setattr(socket, "create_connection", refused)
    with pytest.raises(SystemExit):
        cli.main(["--model", "someone/some-model", "--max-prompt-len", "64", "--bind", "tcp://127.0.0.1:*"])
    assert "127.0.0.1 cannot be reached" in capsys.readouterr().err
    assert probes == [("127.0.0.1", 9)]
    monkeypatch.setattr(hub.time, "monotonic", lambda: 1e12)  # the memory ends: the hub is asked again
    assert not hub.hub_reachable() and len(probes) == 2


def test_a_port_in_use_is_a_usage_error_before_the_model_loads(worker, capsys, monkeypatch):
    from rollout.service.launch import cli, startup

    monkeypatch.setattr(startup, "load_model", lambda *a: pytest.fail("the model was loaded before the bind check"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["--bind", worker.address])
    assert stop.value.code == 2 and "cannot bind" in capsys.readouterr().err


def test_a_client_refuses_a_malformed_address():
    from trainer_bridge import RolloutClient

    with pytest.raises(ValueError, match="is not a ZeroMQ address"):
        RolloutClient("127.0.0.1:5630")

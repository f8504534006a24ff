"""Weight updates against real rollout-worker subprocesses on CPU: `push_weights` over every transport (frames, shm,
auto, torch.distributed with gloo to two workers) makes the workers serve exactly what an in-process model with the
new weights generates; bad updates (unknown, missing, misshapen or mistyped tensors, stale versions, truncated or
misordered bytes, early commits, silent or vanished clients, aborts) are refused naming the culprit and change
nothing; streamed completions carry the version of every token across a push in each mode.

Two worker processes serve the whole module: worker A takes every test, worker B only joins the torch.distributed
ones. References are in-process generations (`generate_batch`, transformers' forward) of `tiny_model(seed)`, the
same architecture as the worker's `--model tiny` (seed 0) with other weights.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from dataclasses import dataclass

import msgpack
import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError, SamplingParams, generate_batch
from rollout import protocol as p
from rollout.presets import tiny_model
from service_helpers import Client, Worker
from trainer_bridge import Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(180)

# Two full KV blocks and then some (block size 16): the prompt's prefix is cached, so a stale cache entry from
# older weights would show in the outputs.
PROMPT = [(37 * i + 5) % 101 for i in range(37)]
SHORT = 16  # tokens compared after every update
LONG = 200  # tokens of the streamed groups that see an update happen
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": SHORT}
BASE_SEED = 4  # what the rejection tests start from
BAD_SEED = 3  # the weights that bad updates carry (they would change the output if applied)
NAME = "model.layers.1.mlp.up_proj.weight"  # the tensor the bad updates spoil
MISSING = "model.layers.2.self_attn.k_proj.weight"


# ---- references ---------------------------------------------------------------------------------------------------
@functools.cache
def weights(seed: int) -> dict[str, torch.Tensor]:
    """The state dict of tiny_model(seed) (every name the worker's model has)."""
    return tiny_model(seed).state_dict()


def _generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    sampling = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=max_new_tokens)
    output = generate_batch(
        model,
        [prompt],
        progress_bar=False,
        sampling=sampling,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=16),
    )["req_0"]
    return list(output.generated_tokens), list(output.logprobs)


@functools.cache
def reference(seed: int, length: int = SHORT) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of an in-process tiny_model(seed) for PROMPT."""
    return _generate(tiny_model(seed), PROMPT, length)


def keep_reference(old_seed: int, new_seed: int, tokens: list[int], switch: int, count: int) -> list[int]:
    """What mode "keep" must generate after the switch, computed with transformers' own forward: KV of the prompt
    and of tokens[:switch - 1] from the old weights (the last old token is fed under the new ones), then greedy
    decoding with the new weights on that cache."""
    old, new = tiny_model(old_seed), tiny_model(new_seed)
    with torch.no_grad():
        cache = old(torch.tensor([PROMPT + tokens[: switch - 1]]), use_cache=True).past_key_values
        current, generated = tokens[switch - 1], []
        for _ in range(count):
            output = new(torch.tensor([[current]]), past_key_values=cache, use_cache=True)
            cache, current = output.past_key_values, int(output.logits[0, -1].argmax())
            generated.append(current)
    return generated


# ---- workers and clients ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workers():
    """Worker A and worker B, started side by side."""
    servers = Worker.several(2)
    yield servers
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def client(workers):
    """A RolloutClient of worker A only."""
    with RolloutClient(workers[0].address, timeout=60) as connection:
        yield connection


@pytest.fixture
def raw(workers):
    """A raw protocol client of worker A."""
    connection = Client(workers[0].address)
    yield connection
    connection.close()


@dataclass
class Served:
    seed: int
    version: int


def push_seed(client: RolloutClient, seed: int, **kwargs) -> Served:
    result = push_weights(client, tiny_model(seed), **kwargs)
    return Served(seed, result.version)


@pytest.fixture
def baseline(client) -> Served:
    """Worker A serving tiny_model(BASE_SEED) (pushed afresh, so no earlier test decides what it serves)."""
    return push_seed(client, BASE_SEED, transport="frames")


def version_of(address: str) -> int:
    connection = Client(address)
    try:
        pong = connection.ask(p.Ping(3))
    finally:
        connection.close()
    assert isinstance(pong, p.Pong) and pong.nonce == 3
    return pong.policy_version


def greedy_of(address: str, prompt: list[int] = PROMPT) -> p.Completion:
    """A greedy completion of `prompt` from one worker (raw socket, so it is that worker and no other)."""
    connection = Client(address)
    try:
        result = connection.ask(p.Generate(uuid.uuid4().hex, prompt, sampling=GREEDY))
    finally:
        connection.close()
    assert isinstance(result, p.GroupResult), result
    return result.completions[0]


def assert_serves(address: str, seed: int, version: int | None = None) -> None:
    """The worker's greedy output (tokens and logprobs) is the in-process reference of tiny_model(seed)."""
    completion = greedy_of(address)
    tokens, logprobs = reference(seed)
    assert completion.token_ids == tokens, f"the worker does not serve tiny_model({seed})'s weights"
    assert completion.logprobs == pytest.approx(logprobs, abs=1e-4)
    if version is not None:
        assert completion.policy_versions == [[version, 0]] and completion.kv_version_min == version
        assert version_of(address) == version


def test_the_seeds_generate_different_tokens():
    """Every check below tells weights apart by their greedy output: the seeds must differ within SHORT tokens."""
    outputs = [tuple(reference(seed)[0]) for seed in range(6)]
    assert len(set(outputs)) == 6


# ---- raw protocol helpers -----------------------------------------------------------------------------------------
def specs_of(state: dict[str, torch.Tensor]) -> list[p.TensorSpec]:
    return [
        p.TensorSpec(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        for name, tensor in state.items()
    ]


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def send_bucket(raw: Client, update_id: str, pieces: list[p.TensorPiece], frames: list[bytes]) -> None:
    """A weights_bucket header and its raw data frames, as they are (no check that they agree)."""
    raw.socket.send_multipart(p.encode(p.WeightsBucket(update_id, pieces)) + list(frames))


def begin(raw: Client, update_id: str, **fields) -> p.Message:
    fields.setdefault("tensors", specs_of(weights(BAD_SEED)))
    return raw.ask(p.WeightsBegin(update_id, **fields))


def assert_no_update_open(raw: Client) -> None:
    """A fresh update can begin at once (nothing was left open), and is dropped again."""
    update_id = uuid.uuid4().hex
    ready = begin(raw, update_id)
    assert isinstance(ready, p.WeightsReady) and ready.update_id == update_id, ready
    ack = raw.ask(p.WeightsAbort(update_id))
    assert isinstance(ack, p.WeightsAck) and ack.state == "aborted", ack


def assert_unchanged(address: str, raw: Client, served: Served, updates_before: int | None = None) -> None:
    assert_serves(address, served.seed, served.version)
    stats = raw.ask(p.Stats())
    assert stats.stats["policy_version"] == served.version
    if updates_before is not None:
        assert stats.stats["weight_updates"] == updates_before
    assert_no_update_open(raw)


# ---- 1. pushes over each transport ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "transport, seed, expected_transport, version_step",
    [("frames", 1, "frames", None), ("shm", 2, "shm", 5), ("auto", 1, "shm", None)],
)
def test_push_serves_the_new_weights(workers, client, raw, transport, seed, expected_transport, version_step):
    """After the push the worker's greedy output equals the in-process model with the new weights; the version grows
    (by one, or to the one asked for) and stats, hello and pong all report it."""
    address = workers[0].address
    before_tokens = greedy_of(address).token_ids
    assert before_tokens != reference(seed)[0], "the worker already serves these weights: the push proves nothing"
    stats_before = client.stats()[0]
    version_before = stats_before["policy_version"]
    asked = None if version_step is None else version_before + version_step
    started = time.time()
    # Odd-sized buckets: tensors split across buckets at offsets that are no multiple of anything.
    result = push_weights(client, tiny_model(seed), version=asked, transport=transport, bucket_bytes=(1 << 20) + 7)
    finished = time.time()

    assert result.version == (version_before + 1 if asked is None else asked)
    assert result.num_bytes >= sum(t.numel() * 4 for t in weights(seed).values())
    [worker] = result.workers
    assert (worker["address"], worker["transport"], worker["version"]) == (address, expected_transport, result.version)
    assert (worker["aborted"], worker["recomputed"]) == (0, 0)

    stats = client.stats()[0]
    assert stats["policy_version"] == result.version
    assert stats["weight_updates"] == stats_before["weight_updates"] + 1
    assert started <= stats["last_weight_update_at"] <= finished
    hello = raw.ask(p.Hello())
    assert isinstance(hello, p.HelloReply) and hello.policy_version == result.version
    pong = raw.ask(p.Ping(42))
    assert isinstance(pong, p.Pong) and (pong.nonce, pong.policy_version) == (42, result.version)
    assert_serves(address, seed, result.version)


def test_auto_falls_back_to_frames_only_when_the_segment_could_not_be_made(workers, client, raw, monkeypatch):
    """transport="auto" began again over frames after any refusal before weights_ready: when another trainer took
    the slot over (update_preempted) before the push heard its ready, a push with preempt=True took it straight
    back. Only a refusal of the transport (field "transport": the worker could not make a segment) falls back now;
    the preemption is the push's answer, and the other trainer keeps the slot."""
    from trainer_bridge.weights import push, push_links

    take, send_begin, begins, other = push_links.PushLink.take, push.WeightPush._send_begin, [], uuid.uuid4().hex

    def other_trainer_preempts_before_ready(link, message):  # the race, made certain: its ready is not heard
        if isinstance(message, p.WeightsReady) and len(begins) == 1:
            taken = raw.ask(p.WeightsBegin(other, specs_of(weights(0))[:1], partial=True, timeout_s=30, preempt=True))
            assert isinstance(taken, p.WeightsReady), taken
            return
        take(link, message)

    def counted(self, link, specs, fields):
        begins.append(link.transport)
        send_begin(self, link, specs, fields)

    monkeypatch.setattr(push_links.PushLink, "take", other_trainer_preempts_before_ready)
    monkeypatch.setattr(push.WeightPush, "_send_begin", counted)
    with pytest.raises(RolloutError) as refused:
        push_weights(client, tiny_model(1), transport="auto", bucket_bytes=1 << 20, preempt=True, timeout=10)
    monkeypatch.undo()
    assert refused.value.code == "update_preempted" and begins == ["shm"], (refused.value, begins)
    ack = raw.ask(p.WeightsAbort(other))  # still the other trainer's: never taken back
    assert isinstance(ack, p.WeightsAck) and ack.state == "aborted", ack
    assert_no_update_open(raw)


def test_raw_transaction_by_hand(workers, raw, baseline):
    """The protocol alone, without push_weights: begin, one bucket per tensor (two frames each), commit."""
    state = weights(5)
    update_id = uuid.uuid4().hex
    ready = begin(raw, update_id, tensors=specs_of(state), version=baseline.version + 3)
    assert isinstance(ready, p.WeightsReady) and ready.shm_name is None
    received = 0
    for index, tensor in enumerate(state.values()):
        data = raw_bytes(tensor)
        half = len(data) // 2
        pieces = [p.TensorPiece(index, 0, half), p.TensorPiece(index, half, len(data) - half)]
        send_bucket(raw, update_id, pieces, [data[:half], data[half:]])
        ack = raw.receive()
        received += len(data)
        assert isinstance(ack, p.WeightsAck) and (ack.state, ack.received_bytes) == ("staging", received), ack
    committed = raw.ask(p.WeightsCommit(update_id))
    assert isinstance(committed, p.WeightsCommitted), committed
    assert (committed.update_id, committed.version) == (update_id, baseline.version + 3)
    assert_serves(workers[0].address, 5, baseline.version + 3)


def test_partial_update(workers, client, raw, baseline):
    """partial=True replaces only the tensors sent; without it the worker names a parameter left out."""
    head = {"lm_head.weight": weights(BAD_SEED)["lm_head.weight"]}
    with pytest.raises(RolloutError) as refused:
        push_weights(client, head, transport="frames")
    assert refused.value.code == "bad_update" and refused.value.field in set(weights(0)) - {"lm_head.weight"}
    assert_unchanged(workers[0].address, raw, baseline)

    result = push_weights(client, head, transport="frames", partial=True)
    mixed = tiny_model(BASE_SEED)
    with torch.no_grad():
        mixed.lm_head.weight.copy_(head["lm_head.weight"])
    tokens, logprobs = _generate(mixed, PROMPT, SHORT)
    completion = greedy_of(workers[0].address)
    assert tokens not in (reference(BASE_SEED)[0], reference(BAD_SEED)[0])
    assert completion.token_ids == tokens and completion.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert completion.policy_versions == [[result.version, 0]]


# ---- 2. bad updates -----------------------------------------------------------------------------------------------
def _renamed(state):
    return {**state, "model.layers.9.mlp.up_proj.weight": state[NAME]}


BAD_PUSHES = {
    "unknown name": (_renamed, {}, "model.layers.9.mlp.up_proj.weight"),
    "missing parameter": (lambda s: {k: v for k, v in s.items() if k != MISSING}, {}, MISSING),
    "wrong shape": (lambda s: {**s, NAME: s[NAME][:, :-1]}, {}, NAME),
    "integer dtype": (lambda s: {**s, NAME: s[NAME].to(torch.int32)}, {}, NAME),
    "same version": (lambda s: s, {"version": 0}, "version"),
    "older version": (lambda s: s, {"version": -1}, "version"),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_refused_naming_the_culprit(workers, client, raw, baseline, case):
    """push_weights raises RolloutError("bad_update") whose field names the tensor or setting; the worker still
    serves the old weights at the old version, counted no update, and has nothing left open."""
    spoil, kwargs, field = BAD_PUSHES[case]
    if "version" in kwargs:
        kwargs = {"version": baseline.version + kwargs["version"]}
    updates = raw.ask(p.Stats()).stats["weight_updates"]
    newest = client.min_policy_version
    if case == "older version":  # refused by the client itself (below its newest push), then, as if that were
        with pytest.raises(FieldError, match="version: .* is below"):  # forgotten, by the workers
            push_weights(client, spoil(dict(weights(BAD_SEED))), transport="frames", **kwargs)
        client.min_policy_version = 0
    try:
        with pytest.raises(RolloutError) as refused:
            push_weights(client, spoil(dict(weights(BAD_SEED))), transport="frames", **kwargs)
    finally:
        client.min_policy_version = newest
    assert (refused.value.code, refused.value.field) == ("bad_update", field), refused.value
    if case == "wrong shape":  # and what it likely means
        assert "the workers serve a model of another size or architecture" in str(refused.value)
    if case == "unknown name":  # (a worker started without the trainer's --model: it serves the tiny preset)
        assert re.search(r"did you mean 'model\.layers\.\d\.mlp\.up_proj\.weight'\?", str(refused.value))
        assert "the workers serve a model of another architecture than this one (rollout-worker --model)" in str(
            refused.value
        )
    assert_unchanged(workers[0].address, raw, baseline, updates)


def _begin_fields(case: str, served: Served) -> tuple[dict, str]:
    """weights_begin fields for a refused begin, and the field its error must name."""
    specs = specs_of(weights(BAD_SEED))
    index = [s.name for s in specs].index(NAME)

    def replaced(**changes):
        spoiled = list(specs)
        spoiled[index] = p.TensorSpec(**{**vars(specs[index]), **changes})
        return spoiled

    cases = {
        "wrong dtype": ({"tensors": replaced(dtype="float16")}, NAME),
        "unknown dtype": ({"tensors": replaced(dtype="complex64")}, NAME),
        "wrong shape": ({"tensors": replaced(shape=[512, 255])}, NAME),
        "negative size": ({"tensors": replaced(shape=[-512, -256])}, NAME),
        "unknown name": ({"tensors": specs + [p.TensorSpec("model.nope", "float32", [4])]}, "model.nope"),
        "announced twice": ({"tensors": specs + [specs[index]]}, NAME),
        "missing parameter": ({"tensors": [s for s in specs if s.name != MISSING]}, MISSING),
        "no tensors": ({"tensors": []}, "tensors"),
        "same version": ({"version": served.version}, "version"),
        "bad mode": ({"mode": "sometimes"}, "mode"),
        "bad transport": ({"transport": "pigeon"}, "transport"),
        "zero timeout": ({"timeout_s": 0.0}, "timeout_s"),
        "dist without rendezvous": ({"transport": "torch.distributed"}, "dist.host"),
    }
    return cases[case]


@pytest.mark.parametrize(
    "case",
    [
        "wrong dtype",
        "unknown dtype",
        "wrong shape",
        "negative size",
        "unknown name",
        "announced twice",
        "missing parameter",
        "no tensors",
        "same version",
        "bad mode",
        "bad transport",
        "zero timeout",
        "dist without rendezvous",
    ],
)
def test_bad_begin_is_refused_naming_the_culprit(workers, raw, baseline, case):
    """A weights_begin with a bad announcement gets Error("bad_update") naming the tensor or field, carrying the
    update id; nothing is left open and nothing changes."""
    fields, field = _begin_fields(case, baseline)
    update_id = uuid.uuid4().hex
    error = begin(raw, update_id, **fields)
    assert isinstance(error, p.Error), error
    assert (error.code, error.field, error.update_id) == ("bad_update", field, update_id), error
    unknown = raw.ask(p.WeightsCommit(update_id))
    assert isinstance(unknown, p.Error) and unknown.code == "unknown_update", unknown
    assert_unchanged(workers[0].address, raw, baseline)


def _bad_bucket(case: str) -> tuple[list[list[p.TensorPiece]], list[list[bytes]], str]:
    """Buckets (pieces and frames) of an update whose last bucket is bad, and the field its error must name."""
    state = weights(BAD_SEED)
    names = list(state)
    first, second = raw_bytes(state[names[0]]), raw_bytes(state[names[1]])
    size = len(first)
    cases = {
        "truncated frame": ([[p.TensorPiece(0, 0, size)]], [[first[:-4]]], names[0]),
        "overlong frame": ([[p.TensorPiece(0, 0, 64)]], [[first[:68]]], names[0]),
        "out of order": (
            [[p.TensorPiece(0, 128, 128), p.TensorPiece(0, 0, 128)]],
            [[first[128:256], first[:128]]],
            names[0],
        ),
        "gap": (
            [[p.TensorPiece(0, 0, 128)], [p.TensorPiece(0, 256, 128)]],
            [[first[:128]], [first[256:384]]],
            names[0],
        ),
        "overlap": (
            [[p.TensorPiece(0, 0, 128)], [p.TensorPiece(0, 64, 128)]],
            [[first[:128]], [first[64:192]]],
            names[0],
        ),
        "past the end": ([[p.TensorPiece(0, 0, size + 4)]], [[first + b"\0" * 4]], names[0]),
        "second tensor past its end": (
            [[p.TensorPiece(0, 0, size), p.TensorPiece(1, 0, len(second) + 64)]],
            [[first, second + b"\0" * 64]],
            names[1],
        ),
        "unknown index": ([[p.TensorPiece(len(names), 0, 4)]], [[b"\0" * 4]], "pieces.index"),
        "missing frame": ([[p.TensorPiece(0, 0, 64), p.TensorPiece(0, 64, 64)]], [[first[:64]]], "pieces"),
    }
    return cases[case]


@pytest.mark.parametrize(
    "case",
    [
        "truncated frame",
        "overlong frame",
        "out of order",
        "gap",
        "overlap",
        "past the end",
        "second tensor past its end",
        "unknown index",
        "missing frame",
    ],
)
def test_bad_bucket_drops_the_update(workers, raw, baseline, case):
    """A bucket whose bytes do not fit its announcement gets Error("bad_update") naming the tensor; the update is
    dropped (a later commit of it is unknown) and the old weights keep serving."""
    buckets, frames, field = _bad_bucket(case)
    update_id = uuid.uuid4().hex
    assert isinstance(begin(raw, update_id, version=baseline.version + 1), p.WeightsReady)
    for pieces, data in zip(buckets[:-1], frames[:-1]):
        send_bucket(raw, update_id, pieces, data)
        assert isinstance(raw.receive(), p.WeightsAck)
    send_bucket(raw, update_id, buckets[-1], frames[-1])
    error = raw.receive()
    assert isinstance(error, p.Error), error
    assert (error.code, error.field, error.update_id) == ("bad_update", field, update_id), error
    unknown = raw.ask(p.WeightsCommit(update_id))
    assert isinstance(unknown, p.Error) and (unknown.code, unknown.update_id) == ("unknown_update", update_id), unknown
    assert_unchanged(workers[0].address, raw, baseline)


def test_malformed_bucket_header_drops_the_update(workers, raw, baseline):
    """A bucket header that does not decode (a piece without nbytes) is answered with an error for the update, which
    is then dropped like any other bad bucket."""
    update_id = uuid.uuid4().hex
    assert isinstance(begin(raw, update_id), p.WeightsReady)
    header = {
        "protocol": p.PROTOCOL_VERSION,
        "type": "weights_bucket",
        "update_id": update_id,
        "pieces": [{"index": 0, "offset": 0}],
    }
    raw.socket.send_multipart([msgpack.packb(header), b"\0" * 4])
    error = raw.receive()
    assert isinstance(error, p.Error), error
    assert (error.field, error.update_id) == ("pieces[0].nbytes", update_id), error
    unknown = raw.ask(p.WeightsCommit(update_id))
    assert isinstance(unknown, p.Error) and unknown.code == "unknown_update", unknown
    assert_unchanged(workers[0].address, raw, baseline)


def test_commit_before_every_byte_arrived_names_the_incomplete_tensor(workers, raw, baseline):
    state = weights(BAD_SEED)
    names = list(state)
    first, second = raw_bytes(state[names[0]]), raw_bytes(state[names[1]])
    update_id = uuid.uuid4().hex
    assert isinstance(begin(raw, update_id), p.WeightsReady)
    send_bucket(raw, update_id, [p.TensorPiece(0, 0, len(first)), p.TensorPiece(1, 0, 1024)], [first, second[:1024]])
    ack = raw.receive()
    assert isinstance(ack, p.WeightsAck) and ack.received_bytes == len(first) + 1024
    error = raw.ask(p.WeightsCommit(update_id))
    assert isinstance(error, p.Error), error
    assert (error.code, error.field, error.update_id) == ("bad_update", names[1], update_id), error
    assert_unchanged(workers[0].address, raw, baseline)


def test_silent_client_times_out_per_phase(workers, raw, baseline):
    """Every message restarts the phase deadline (timeout_s); after a silence longer than it the client gets
    Error("update_timeout") with its update id, and a new update can begin."""
    update_id = uuid.uuid4().hex
    assert isinstance(begin(raw, update_id, timeout_s=1.0), p.WeightsReady)
    time.sleep(0.6)
    first = raw_bytes(weights(BAD_SEED)["model.embed_tokens.weight"])
    send_bucket(raw, update_id, [p.TensorPiece(0, 0, 4096)], [first[:4096]])
    sent = time.monotonic()
    assert isinstance(raw.receive(), p.WeightsAck)  # 0.6 s after begin: still in time
    error = raw.receive(timeout_s=10)
    waited = time.monotonic() - sent
    assert isinstance(error, p.Error), error
    assert (error.code, error.update_id) == ("update_timeout", update_id), error
    assert 0.9 <= waited < 5, f"the deadline is 1 s after the last message, the error came after {waited:.2f} s"
    assert_unchanged(workers[0].address, raw, baseline)


def test_vanished_client_update_is_dropped_when_its_connection_closes(workers, client, raw, baseline):
    """A client that begins, sends a bucket and disappears does not hold the update slot: its closed connection
    drops the update (before its phase deadline), and another client's push goes through."""
    doomed = Client(workers[0].address)
    try:
        update_id = uuid.uuid4().hex
        assert isinstance(begin(doomed, update_id, timeout_s=1.5), p.WeightsReady)
        first = raw_bytes(weights(BAD_SEED)["model.embed_tokens.weight"])
        sent = time.monotonic()
        send_bucket(doomed, update_id, [p.TensorPiece(0, 0, 4096)], [first[:4096]])
        assert isinstance(doomed.receive(), p.WeightsAck)
    finally:
        doomed.close()
    assert_serves(workers[0].address, baseline.seed, baseline.version)
    while True:
        try:
            result = push_weights(client, tiny_model(5), transport="frames")
            break
        except RolloutError as error:
            assert error.code == "update_in_progress", error
            assert time.monotonic() - sent < 10, "the vanished client's update was never dropped"
            time.sleep(0.1)
    assert result.version == baseline.version + 1
    assert_serves(workers[0].address, 5, result.version)


def test_abort_drops_an_open_update(workers, client, raw, baseline):
    """weights_abort answers an ack with state "aborted" and the bytes staged so far; the update is gone (neither
    commit nor abort know it, another client may begin at once); only its owner may touch it before."""
    update_id = uuid.uuid4().hex
    assert isinstance(begin(raw, update_id), p.WeightsReady)
    first = raw_bytes(weights(BAD_SEED)["model.embed_tokens.weight"])
    send_bucket(raw, update_id, [p.TensorPiece(0, 0, len(first))], [first])
    assert isinstance(raw.receive(), p.WeightsAck)
    intruder = Client(workers[0].address)
    try:
        for message in (p.WeightsCommit(update_id), p.WeightsAbort(update_id)):
            error = intruder.ask(message)
            assert isinstance(error, p.Error) and error.code == "unknown_update", error
    finally:
        intruder.close()
    ack = raw.ask(p.WeightsAbort(update_id))
    assert isinstance(ack, p.WeightsAck), ack
    assert (ack.update_id, ack.state, ack.received_bytes) == (update_id, "aborted", len(first))
    for message in (p.WeightsCommit(update_id), p.WeightsAbort(update_id)):
        error = raw.ask(message)
        assert isinstance(error, p.Error) and error.code == "unknown_update", error
    assert_unchanged(workers[0].address, raw, baseline)
    result = push_weights(client, tiny_model(5), transport="frames")
    assert_serves(workers[0].address, 5, result.version)


# ---- 3. version tags of a streamed group across a push ------------------------------------------------------------
def _stream_across_push(client: RolloutClient, new_seed: int, version: int, mode: str):
    """Stream LONG greedy tokens; after a few deltas push tiny_model(new_seed). Returns (deltas, completion,
    push result)."""
    model = tiny_model(new_seed)
    deltas: list[Delta] = []
    result = final = None
    sampling = {**GREEDY, "max_new_tokens": LONG}
    for event in client.stream(PromptGroup(PROMPT, sampling=sampling), timeout=60):
        if isinstance(event, Delta):
            deltas.append(event)
            if len(deltas) == 4:
                result = push_weights(client, model, version=version, mode=mode, transport="frames")
        else:
            assert isinstance(event, GroupResult)
            final = event
    assert result is not None and final is not None
    [completion] = final.completions
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    return deltas, completion, result


def _version_at(runs: list[list[int]], index: int) -> int:
    return [version for version, first in runs if first <= index][-1]


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_streamed_versions_across_a_push(workers, client, mode):
    """A long greedy stream during a push: tokens before the switch are the old model's, after it what the mode
    says; policy_versions has a run per version, each delta carries its tokens' version."""
    v0 = version_of(workers[0].address) + 10  # explicit versions, as a trainer's steps
    assert push_seed(client, 1, transport="frames", version=v0).version == v0
    v1 = v0 + 1
    reference_old = reference(1, LONG)[0]
    deltas, completion, result = _stream_across_push(client, 2, v1, mode)
    tokens, runs = completion.token_ids, completion.policy_versions
    assert result.version == v1
    for delta in deltas:  # each delta: its tokens' version
        start = sum(len(d.token_ids) for d in deltas[: deltas.index(delta)])
        assert {_version_at(runs, start + i) for i in range(len(delta.token_ids))} == {delta.policy_version}

    if mode == "abort":
        assert completion.finish_reason == "abort"
        assert 4 <= len(tokens) < LONG and runs == [[v0, 0]] and completion.kv_version_min == v0
        assert tokens == reference_old[: len(tokens)]
        assert (result.workers[0]["aborted"], result.workers[0]["recomputed"]) == (1, 0)
    else:
        assert completion.finish_reason == "length" and len(tokens) == LONG
        assert len(runs) == 2 and runs[0] == [v0, 0] and runs[1][0] == v1, runs
        switch = runs[1][1]
        assert 4 <= switch < LONG, runs
        assert tokens[:switch] == reference_old[:switch]
        assert {d.policy_version for d in deltas} == {v0, v1}
        if mode == "keep":
            assert completion.kv_version_min == v0 and result.workers[0]["recomputed"] == 0
            count = min(24, LONG - switch)
            assert tokens[switch : switch + count] == keep_reference(1, 2, tokens, switch, count)
        else:
            assert completion.kv_version_min == v1 and result.workers[0]["recomputed"] == 1
            count = min(24, LONG - switch)
            expected, _ = _generate(tiny_model(2), PROMPT + tokens[:switch], count)
            assert tokens[switch : switch + count] == expected
    assert_serves(workers[0].address, 2, v1)
    # A new group whose prompt is the streamed sequence (its blocks straddle the switch) gets no KV computed, even
    # partly, under the old weights from the prefix cache.
    prompt = PROMPT + tokens[:60]
    completion = greedy_of(workers[0].address, prompt)
    assert completion.token_ids == _generate(tiny_model(2), prompt, SHORT)[0]


def test_wait_mode_drains_in_flight_samples_first(workers, client):
    """mode="wait": the push returns only after the stream in flight finished on the old weights, and reports how
    long that drain took; the next group gets the new weights."""
    old = push_seed(client, 1, transport="frames")
    deltas, completion, result = _stream_across_push(client, 2, old.version + 1, "wait")
    assert completion.finish_reason == "length" and completion.token_ids == reference(1, LONG)[0]
    assert completion.policy_versions == [[old.version, 0]] and completion.kv_version_min == old.version
    assert {d.policy_version for d in deltas} == {old.version}
    drain_ms = result.workers[0]["drain_ms"]
    assert 0 < drain_ms <= result.total_s * 1000
    assert_serves(workers[0].address, 2, old.version + 1)


def test_wait_mode_drain_past_its_timeout_is_dropped(workers, client):
    """mode="wait" whose in-flight sample outlasts the timeout: the update is dropped with update_timeout naming
    "mode", the old weights keep serving, new groups are admitted again, and the sample goes on at the old version."""
    old = push_seed(client, 1, transport="frames")
    # About 3 s of decoding on this machine's CPU, against a drain deadline of 1 s.
    stream = client.stream(PromptGroup(PROMPT, sampling={**GREEDY, "max_new_tokens": 2000}), timeout=60)
    first = [next(stream) for _ in range(4)]
    started = time.monotonic()
    with pytest.raises(RolloutError) as dropped:
        push_weights(client, tiny_model(2), mode="wait", timeout=1.0, transport="frames")
    assert (dropped.value.code, dropped.value.field) == ("update_timeout", "mode"), dropped.value
    assert time.monotonic() - started >= 1.0
    # Admission is open again while the long sample still runs (a paused one would never admit this group).
    short = client.generate(PromptGroup([7, 8, 9], sampling=GREEDY), timeout=30).completions[0]
    assert len(short.token_ids) == SHORT and short.policy_versions == [[old.version, 0]]
    client.cancel(first[0].group_id)
    [result] = [event for event in stream if isinstance(event, GroupResult)]
    [completion] = result.completions
    assert completion.finish_reason == "abort" and completion.policy_versions == [[old.version, 0]]
    tokens = completion.token_ids
    assert 4 <= len(tokens) < 2000
    assert tokens[:LONG] == reference(1, LONG)[0][: len(tokens)]
    assert_serves(workers[0].address, 1, old.version)


# ---- 4. torch.distributed (gloo on CPU) to two workers --------------------------------------------------------------
def test_a_push_without_a_version_gives_workers_apart_one_version_above_all(workers, client):
    """Worker A ahead of B (a restarted worker starts at 0): a push with no version commits one number on both,
    above either's and above what this client pushed, so B is routed to again (each adding one to its own version
    committed different numbers, then raised version_mismatch with the new weights serving)."""
    addresses = [worker.address for worker in workers]
    ahead = push_weights(client, tiny_model(1), version=max(map(version_of, addresses)) + 3, transport="frames")
    assert version_of(addresses[0]) == ahead.version > version_of(addresses[1])
    with RolloutClient(addresses, timeout=60) as both:
        both.min_policy_version = ahead.version + 2  # a version this client pushed to a worker since lost
        result = push_weights(both, tiny_model(2), transport="frames")
        assert result.version == ahead.version + 3 and both.min_policy_version == result.version
        for address in addresses:
            assert_serves(address, 2, result.version)


def test_torch_distributed_to_two_workers(workers):
    """Buckets broadcast over a gloo group of the trainer and both workers: both serve exactly the pushed model,
    push after push (nothing stale from the previous push); a refused push names the culprit, changes neither
    worker, and the next push works."""
    addresses = [worker.address for worker in workers]
    with RolloutClient(addresses, timeout=60) as both:
        start = push_weights(both, tiny_model(0), transport="frames", version=max(map(version_of, addresses)) + 1)
        version = start.version
        for seed in (1, 2):
            version += 10
            result = push_weights(
                both, tiny_model(seed), version=version, transport="torch.distributed", dist_backend="gloo"
            )
            assert result.version == version
            assert [(w["address"], w["transport"], w["version"]) for w in result.workers] == [
                (address, "torch.distributed", version) for address in addresses
            ]
            for address in addresses:
                assert_serves(address, seed, version)

        spoiled = {k: v for k, v in weights(BAD_SEED).items() if k != MISSING}
        with pytest.raises(RolloutError) as refused:  # its abandoned rendezvous lasts its timeout: keep it short
            push_weights(
                both, spoiled, version=version + 1, transport="torch.distributed", dist_backend="gloo", timeout=5
            )
        assert (refused.value.code, refused.value.field) == ("bad_update", MISSING)
        for address in addresses:
            assert_serves(address, 2, version)

        result = push_weights(
            both, tiny_model(5), version=version + 2, transport="torch.distributed", dist_backend="gloo", timeout=20
        )
        for address in addresses:
            assert_serves(address, 5, result.version)


def test_torch_distributed_refusal_is_reported_promptly(workers):
    """A worker that refuses a torch.distributed update at begin (here a missing parameter) never joins the group;
    the push should fail with the refusal as fast as it does over frames, not after its full timeout."""
    spoiled = {k: v for k, v in weights(BAD_SEED).items() if k != MISSING}
    with RolloutClient(workers[0].address, timeout=60) as fresh:  # no cached group
        started = time.monotonic()
        with pytest.raises(RolloutError) as refused:
            push_weights(fresh, spoiled, transport="torch.distributed", dist_backend="gloo", timeout=3.0)
        elapsed = time.monotonic() - started
    assert (refused.value.code, refused.value.field) == ("bad_update", MISSING)
    assert elapsed < 1.5, f"the refusal took {elapsed:.1f} s to surface (timeout 3 s)"


def test_torch_distributed_push_after_a_worker_restart(workers):
    """A worker restarted at the same address (what RolloutClient's revive logic expects) gets the next push."""
    addresses = [worker.address for worker in workers]
    with RolloutClient(addresses, timeout=60) as both:
        version = max(map(version_of, addresses)) + 10
        push_weights(both, tiny_model(1), version=version, transport="torch.distributed", dist_backend="gloo")
        workers[1].close()
        workers[1] = Worker(address=addresses[1])  # the module fixture stops this one
        # A push goes to the workers the client knows alive: wait until its reconnect saw the new process answer
        # (the worker answered the fixture's ping; the client's own connection may come a moment later).
        deadline = time.monotonic() + 20
        while both.live_workers() != [0, 1]:
            assert time.monotonic() < deadline, "the restarted worker never answered the client"
            time.sleep(0.05)
        result = push_weights(
            both, tiny_model(2), version=version + 1, transport="torch.distributed", dist_backend="gloo", timeout=5
        )
        assert [w["address"] for w in result.workers] == addresses
        for address in addresses:
            assert_serves(address, 2, result.version)


def test_staging_pool_keeps_and_releases_areas():
    """The worker's staging pool hands the kept area back when it is large enough, a new one when not, and frees
    everything (the shared segment unlinked) when not keeping or on close."""
    import os
    from multiprocessing import shared_memory

    from rollout.protocol.staging import StagingPool

    pool = StagingPool(keep=True)
    host = pool.host(1000)
    pool.give_back(host, None)
    assert pool.host(800).data_ptr() == host.data_ptr()  # reused while large enough
    pool.give_back(host, None)
    assert pool.host(5000).numel() >= 5000  # too small: a new one
    segment, view = pool.shared(4096)
    name = segment.name
    pool.give_back(None, (segment, view))
    again = pool.shared(100)
    assert again[0].name == name
    pool.give_back(None, again)
    del segment, view, again
    pool.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)

    # A kept segment another process shrank (reading it would end the worker) or unlinked (a trainer attaches by
    # name) is replaced, not reused.
    for spoil in (lambda name: os.truncate(f"/dev/shm/{name}", 0), lambda name: os.unlink(f"/dev/shm/{name}")):
        pool = StagingPool(keep=True)
        segment, view = pool.shared(4096)
        name = segment.name
        pool.give_back(None, (segment, view))
        spoil(name)
        fresh = pool.shared(4096)
        assert fresh[0].name != name and os.path.getsize(f"/dev/shm/{fresh[0].name}") >= 4096
        pool.give_back(None, fresh)
        del segment, view, fresh
        pool.close()

    dropping = StagingPool(keep=False)
    shared = dropping.shared(64)
    name = shared[0].name
    dropping.give_back(dropping.host(64), shared)
    del shared
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    assert dropping.host(64).numel() == 64


def test_a_refused_dist_push_does_not_hold_up_the_next(workers):
    """Worker B is busy with another client's update, so a torch.distributed push to A and B is refused at once;
    worker A had already started joining that push's group. Once B is free, the next push goes through promptly:
    the abandoned rendezvous on A does not stand in its way."""
    addresses = [worker.address for worker in workers]
    blocker = Client(addresses[1])
    try:
        opened = blocker.ask(p.WeightsBegin("blocker", specs_of(weights(0)), timeout_s=30.0))
        assert isinstance(opened, p.WeightsReady), opened
        with RolloutClient(addresses, timeout=60) as both:
            version = max(map(version_of, addresses)) + 1
            with pytest.raises(RolloutError) as refused:
                push_weights(both, tiny_model(1), version=version, transport="torch.distributed", timeout=8.0)
            assert refused.value.code == "update_in_progress", refused.value
            aborted = blocker.ask(p.WeightsAbort("blocker"))
            assert isinstance(aborted, p.WeightsAck) and aborted.state == "aborted"
            started = time.monotonic()
            result = push_weights(both, tiny_model(2), version=version, transport="torch.distributed", timeout=8.0)
            assert time.monotonic() - started < 5.0
    finally:
        blocker.close()
    assert result.version == version
    for address in addresses:
        assert_serves(address, 2, version)


def test_a_commit_that_fails_on_one_worker_says_which_committed(workers):
    """mode="wait" with a long sample in flight on worker A only: B commits, A's drain runs out; the error says the
    commit failed on A while B committed, with B's version, and each worker serves what it says. The pushing client
    sends its groups to B from then on, never to A's older weights (they all went to A before)."""
    addresses = [worker.address for worker in workers]
    with RolloutClient(addresses, timeout=60) as both, RolloutClient(addresses[0], timeout=60) as only_a:
        start = max(map(version_of, addresses)) + 1
        push_weights(both, tiny_model(1), version=start, transport="frames")
        stream = only_a.stream(PromptGroup(PROMPT, sampling={**GREEDY, "max_new_tokens": 2000}), timeout=60)
        [next(stream) for _ in range(4)]
        with pytest.raises(RolloutError) as partial:
            push_weights(both, tiny_model(2), version=start + 1, mode="wait", timeout=1.0, transport="frames")
        stream.close()
        assert both.min_policy_version == start + 1
        served = [
            both.generate(PromptGroup(PROMPT, sampling=GREEDY), timeout=30).completions[0].policy_versions
            for _ in range(6)
        ]
        assert served == [[[start + 1, 0]]] * 6, served
    assert partial.value.code == "partial_commit", partial.value
    assert addresses[1] in str(partial.value) and f"version {start + 1}" in str(partial.value)
    assert version_of(addresses[0]) == start and version_of(addresses[1]) == start + 1


def test_a_worker_lost_after_it_committed_still_counts_as_committed(workers, monkeypatch):
    """As above, but B stalls (SIGSTOP) right after saying it committed, long enough to be declared lost before A's
    drain runs out: the push said "rejected" (B left out of the account), the client's floor stayed, and once B
    answered again groups went to both weights. Now it is a partial_commit naming B, and groups go to B alone."""
    import os
    import signal

    from trainer_bridge.weights import push_links

    addresses = [worker.address for worker in workers]
    stalled = []
    take = push_links.PushLink.take

    def stall_b_after_its_commit(link, message):
        take(link, message)
        if isinstance(message, p.WeightsCommitted) and link.address == addresses[1] and not stalled:
            stalled.append(workers[1].process.pid)
            os.kill(stalled[0], signal.SIGSTOP)

    with (
        RolloutClient(addresses, timeout=60, heartbeat_s=0.2, dead_after_s=0.8) as both,
        RolloutClient(addresses[0], timeout=60) as only_a,
    ):
        start = max(map(version_of, addresses)) + 1
        push_weights(both, tiny_model(1), version=start, transport="frames")
        stream = only_a.stream(PromptGroup(PROMPT, sampling={**GREEDY, "max_new_tokens": 2000}), timeout=60)
        [next(stream) for _ in range(4)]
        monkeypatch.setattr(push_links.PushLink, "take", stall_b_after_its_commit)
        try:
            with pytest.raises(RolloutError) as partial:
                push_weights(both, tiny_model(2), version=start + 1, mode="wait", timeout=3.0, transport="frames")
        finally:
            for pid in stalled:
                os.kill(pid, signal.SIGCONT)
        monkeypatch.undo()
        stream.close()
        assert stalled and both.min_policy_version == start + 1
        served = [
            both.generate(PromptGroup(PROMPT, sampling=GREEDY), timeout=30).completions[0].policy_versions
            for _ in range(4)
        ]
        assert served == [[[start + 1, 0]]] * 4, served
    assert partial.value.code == "partial_commit", partial.value
    assert f"{addresses[1]} (version {start + 1}) committed" in str(partial.value)
    assert f"with no version or one above {start + 1}" in str(partial.value)
    assert version_of(addresses[0]) == start and version_of(addresses[1]) == start + 1


def test_a_trainer_opens_only_staging_segments():
    """The trainer writes into the segment a worker's weights_ready names: a name that is no staging segment's (a
    rogue or broken worker naming another program's shared memory of the same user) is refused unopened."""
    from multiprocessing import shared_memory

    from rollout.protocol.staging import StagingPool, attach_shared_memory, release_segment

    other = shared_memory.SharedMemory(name=f"another-program-{uuid.uuid4().hex[:8]}", create=True, size=64)
    try:
        for name in (other.name, f"/{other.name}", "rollout-../../x", "rollout-0123", None):
            with pytest.raises(OSError, match="is not a rollout staging segment's name"):
                attach_shared_memory(name)
    finally:
        other.close()
        other.unlink()
    pool = StagingPool(keep=False)
    segment, view = pool.shared(64)
    try:
        attached = attach_shared_memory(segment.name)  # a worker's own is opened
        attached.close()
    finally:
        release_segment(segment, view)
        pool.close()


def test_a_shared_segment_that_cannot_be_reserved_is_refused(monkeypatch):
    """/dev/shm too small (posix_fallocate fails): the pool raises OSError (the worker then refuses transport "shm",
    and "auto" falls back to frames) and leaves no segment behind."""
    import errno
    import os as os_module
    from multiprocessing import shared_memory

    from rollout.protocol import staging

    created = []
    real = shared_memory.SharedMemory

    def recording(*args, **kwargs):
        segment = real(*args, **kwargs)
        created.append(segment.name)
        return segment

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging.shared_memory, "SharedMemory", recording)
    monkeypatch.setattr(os_module, "posix_fallocate", no_space)
    with pytest.raises(OSError):
        staging.StagingPool().shared(1 << 20)
    assert created
    monkeypatch.setattr(staging.shared_memory, "SharedMemory", real)
    with pytest.raises(FileNotFoundError):
        real(name=created[0])


def test_a_push_that_times_out_names_the_worker_that_did_not_answer(workers):
    """Worker B is frozen (SIGSTOP) but not yet declared dead: the push times out, naming B alone (it said only that
    no weights_spec came), and neither worker changes weights."""
    import signal

    addresses = [worker.address for worker in workers]
    frozen = workers[1].process
    with RolloutClient(addresses, timeout=60, heartbeat_s=0.2, dead_after_s=60.0) as both:
        # Both answer at once from here (each keeps its weights_spec reply): only the frozen one can be late.
        push_weights(both, tiny_model(3), version=max(map(version_of, addresses)) + 1, transport="frames")
        before = [version_of(address) for address in addresses]
        frozen.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RolloutError) as timed_out:
                push_weights(both, tiny_model(4), version=max(before) + 1, transport="frames", timeout=3.0)
        finally:
            frozen.send_signal(signal.SIGCONT)
        assert timed_out.value.code == "timeout"
        assert f"no weights_spec from {addresses[1]} within" in str(timed_out.value)
        assert addresses[0] not in str(timed_out.value)
        assert [version_of(address) for address in addresses] == before


def test_a_worker_that_missed_a_push_gets_no_groups_while_an_up_to_date_one_serves(workers):
    """Worker B is frozen (SIGSTOP) through a push, so only A takes it, at once; B then answers again with older weights. The
    client sends new groups to A only (B's generated-token count stays put) until a push brings B up to date."""
    import signal

    addresses = [worker.address for worker in workers]
    frozen = workers[1].process
    with RolloutClient(addresses, timeout=60, heartbeat_s=0.2, dead_after_s=1.0) as both:
        version = max(map(version_of, addresses)) + 1
        push_weights(both, tiny_model(1), version=version, transport="frames")
        frozen.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while both.live_workers() != [0] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert both.live_workers() == [0], "B should be declared dead"
            started = time.monotonic()
            result = push_weights(both, tiny_model(2), version=version + 1, transport="frames")
            assert [w["address"] for w in result.workers] == [addresses[0]]
            # A silent worker does not hold the push up (it used to wait out the client's 20 s connect_timeout).
            assert time.monotonic() - started < 10.0
        finally:
            frozen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while both.live_workers() != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert both.live_workers() == [0, 1], "B should answer again"
        b_tokens = {s["address"]: s["generated_tokens"] for s in both.stats()}[addresses[1]]
        groups = [PromptGroup(PROMPT, sampling={**GREEDY, "max_new_tokens": 8}) for _ in range(6)]
        for result in both.generate_many(groups):
            assert result.completions[0].policy_versions == [[version + 1, 0]]
        assert {s["address"]: s["generated_tokens"] for s in both.stats()}[addresses[1]] == b_tokens
        push_weights(both, tiny_model(2), version=version + 2, transport="frames")  # both current again
        assert version_of(addresses[1]) == version + 2

"""Fault injection against a real rollout-worker (CPU, `--model tiny`): a trainer whose connection drops at each
phase of an update (begin, mid-buckets, before commit; over frames and shm), a commit sent twice, versions that do
not grow. After each fault the worker serves exactly the old weights (greedy tokens and policy versions as before),
its update slot is free (a new push from another client succeeds at once), the dropped update's shared-memory
segment is unlinked and no update thread is left behind."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch

from rollout import protocol as p
from rollout.presets import tiny_model
from rollout.protocol.staging import attach_shared_memory, bucket_checksum, staging_layout
from service_helpers import Client, Worker
from trainer_bridge import PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(120)

PROMPT = [(37 * i + 5) % 101 for i in range(37)]
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 12}
SEEDS = itertools.count(10)  # each push brings weights no push brought before


@pytest.fixture(scope="module")
def worker():
    server = Worker("--max-update-phase-s", "60")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(worker):
    with RolloutClient(worker.address, timeout=30) as rollout_client:
        yield rollout_client


def served(client: RolloutClient) -> tuple[list[int], list[list[int]], int]:
    """(greedy tokens, their policy versions, the worker's version)."""
    completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY), timeout=30).completions[0]
    return list(completion.token_ids), completion.policy_versions, client.stats(timeout=10)[0]["policy_version"]


def num_threads(worker: Worker) -> int:
    """The worker process's threads (each update has a job thread of its own while it is open)."""
    return len(os.listdir(f"/proc/{worker.process.pid}/task"))


def eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def open_update(
    raw: Client, state: dict, transport: str, update_id: str, mode: str = "keep", timeout_s: float = 30.0
) -> tuple[list[str], p.WeightsReady]:
    """weights_begin announcing every tensor of `state` (`timeout_s`: each phase's deadline, a "wait" drain's too);
    returns the names in order and weights_ready."""
    names = list(state)
    specs = [p.TensorSpec(name, "float32", list(state[name].shape)) for name in names]
    raw.send(p.WeightsBegin(update_id, specs, None, mode, transport, False, timeout_s, {}, False))
    ready = raw.receive()
    assert isinstance(ready, p.WeightsReady), ready
    return names, ready


def send_buckets(raw: Client, state: dict, names: list[str], count: int, transport: str, ready, update_id: str):
    """The first `count` tensors, one bucket each (written into the worker's segment for shm)."""
    specs = [p.TensorSpec(name, "float32", list(state[name].shape)) for name in names]
    offsets, _ = staging_layout(specs)
    segment = attach_shared_memory(ready.shm_name) if transport == "shm" else None
    try:
        for index, name in enumerate(names[:count]):
            data = state[name].contiguous().view(-1).view(torch.uint8)
            header = p.WeightsBucket(update_id, [p.TensorPiece(index, 0, data.numel())], bucket_checksum([data]))
            if segment is None:
                raw.socket.send_multipart(p.encode(header) + [memoryview(data.numpy())])
            else:
                view = torch.frombuffer(segment.buf, dtype=torch.uint8)
                view[offsets[index] : offsets[index] + data.numel()].copy_(data)
                del view
                raw.send(header)
            assert isinstance(raw.receive(), p.WeightsAck)
    finally:
        if segment is not None:
            segment.close()


@pytest.mark.parametrize("transport", ["frames", "shm"])
@pytest.mark.parametrize("phase", ["after_begin", "mid_buckets", "before_commit"])
def test_a_trainer_that_drops_mid_update_leaves_the_old_weights_and_a_free_slot(worker, client, transport, phase):
    before = served(client)
    threads = num_threads(worker)
    state = tiny_model(seed=3).state_dict()
    raw = Client(worker.address)
    names, ready = open_update(raw, state, transport, f"drop-{transport}-{phase}")
    count = {"after_begin": 0, "mid_buckets": len(names) // 2, "before_commit": len(names)}[phase]
    send_buckets(raw, state, names, count, transport, ready, f"drop-{transport}-{phase}")
    raw.close()  # the trainer's process is gone: its connection closes
    assert eventually(lambda: num_threads(worker) <= threads), (num_threads(worker), threads)
    if ready.shm_name is not None:  # unlinked with the dropped update (a client that did not hear may write into it)
        assert eventually(lambda: not os.path.exists(f"/dev/shm/{ready.shm_name}"))
    assert served(client) == before  # the same tokens, of the same version
    started = time.monotonic()
    result = push_weights(client, tiny_model(seed=next(SEEDS)), transport=transport, timeout=10)  # no preempt needed
    assert time.monotonic() - started < 5
    tokens, versions, version = served(client)
    assert version == result.version == before[2] + 1 and versions == [[version, 0]]
    assert tokens != before[0]


def test_a_commit_sent_twice_is_applied_once(worker, client):
    _, _, version = served(client)
    state = tiny_model(seed=6).state_dict()
    raw = Client(worker.address)
    try:
        names, ready = open_update(raw, state, "frames", "twice")
        send_buckets(raw, state, names, len(names), "frames", ready, "twice")
        raw.send(p.WeightsCommit("twice"))
        raw.send(p.WeightsCommit("twice"))
        replies = [raw.receive(), raw.receive()]
        committed = [reply for reply in replies if isinstance(reply, p.WeightsCommitted)]
        refused = [reply for reply in replies if isinstance(reply, p.Error)]
        assert len(committed) == 1 and committed[0].version == version + 1
        assert [error.code for error in refused] == ["update_committing"]
        raw.send(p.WeightsCommit("twice"))  # once more, after it committed: no such update any more
        late = raw.receive()
        assert isinstance(late, p.Error) and late.code == "unknown_update"
    finally:
        raw.close()
    assert served(client)[2] == version + 1


def test_versions_that_do_not_grow_are_refused_and_change_nothing(worker, client):
    before = served(client)
    for version in (before[2], before[2] - 1):
        with RolloutClient(worker.address, timeout=30) as fresh:  # no memory of what was pushed: the worker refuses
            with pytest.raises(RolloutError) as refused:
                push_weights(fresh, tiny_model(seed=7), version=version, timeout=10)
        assert refused.value.field == "version"
        assert served(client) == before


@pytest.mark.parametrize("when", ["before_a_bucket", "before_commit"])
def test_a_truncated_segment_is_refused_and_the_worker_serves_on(worker, client, when):
    """A process on the worker's host that shrinks an update's shared segment (a trainer's bug) before a bucket gets
    the update refused naming "transport", where reading the segment's pages had ended the worker with SIGBUS; once
    every bucket was copied out of it the segment is no longer read, and the commit lands."""
    before = served(client)
    state = tiny_model(seed=next(SEEDS)).state_dict()
    raw = Client(worker.address)
    update_id = f"truncated-{when}"
    try:
        names, ready = open_update(raw, state, "shm", update_id)
        if when == "before_commit":
            send_buckets(raw, state, names, len(names), "shm", ready, update_id)
        os.truncate(f"/dev/shm/{ready.shm_name}", 0)
        if when == "before_a_bucket":
            data = state[names[0]].contiguous().view(-1).view(torch.uint8)
            raw.send(p.WeightsBucket(update_id, [p.TensorPiece(0, 0, data.numel())], bucket_checksum([data])))
            refused = raw.receive()
            assert isinstance(refused, p.Error) and refused.field == "transport", refused
            assert "shrank to 0 bytes" in refused.message, refused
        else:
            raw.send(p.WeightsCommit(update_id))
            committed = raw.receive()
            assert isinstance(committed, p.WeightsCommitted) and committed.version == before[2] + 1, committed
    finally:
        raw.close()
    assert worker.process.poll() is None
    if when == "before_a_bucket":
        assert served(client) == before
    else:
        assert served(client)[2] == before[2] + 1


def test_a_segment_truncated_under_the_trainer_fails_its_push_not_the_trainer(worker, client, monkeypatch):
    """The segment shrunk after push_weights opened it: the trainer's next write into it ended the trainer with
    SIGBUS (the worker refused and served on). Now the push fails naming "transport" and the worker's address, the
    update is given up on the worker, and a push that follows lands."""
    from rollout.protocol.transports import shm

    attach = shm.ShmSender.attach

    def attach_then_truncate(self, link, ready, specs):  # another process on the host truncates it
        attach(self, link, ready, specs)
        os.truncate(f"/dev/shm/{ready.shm_name}", 0)

    before = served(client)
    monkeypatch.setattr(shm.ShmSender, "attach", attach_then_truncate)
    with pytest.raises(RolloutError) as refused:
        push_weights(client, tiny_model(seed=next(SEEDS)), transport="shm", timeout=10)
    monkeypatch.undo()
    assert (refused.value.code, refused.value.field) == ("bad_update", "transport"), refused.value
    assert f"{worker.address}'s shared-memory segment" in str(refused.value) and "shrank to 0 bytes" in str(
        refused.value
    )
    assert served(client) == before and worker.process.poll() is None
    assert push_weights(client, tiny_model(seed=next(SEEDS)), transport="shm", timeout=10).version == before[2] + 1


def test_bytes_written_into_the_segment_after_their_check_change_nothing(worker, client):
    """The worker copies each bucket out of the shared segment before checking it, so NaN a trainer writes into the
    segment after its buckets were acknowledged, before and right after the commit, changes nothing: the model
    serves what was checked, the tokens a frames push of the same tensors gives. (The engine copied from the
    segment at commit: NaN weights were committed.)"""
    before = served(client)
    seed = next(SEEDS)
    state = tiny_model(seed=seed).state_dict()
    raw = Client(worker.address)
    try:
        names, ready = open_update(raw, state, "shm", "overwritten")
        send_buckets(raw, state, names, len(names), "shm", ready, "overwritten")
        segment = attach_shared_memory(ready.shm_name)
        view = torch.frombuffer(segment.buf, dtype=torch.uint8)
        view.fill_(255)  # every float32 of the update reads NaN now
        raw.send(p.WeightsCommit("overwritten"))
        view.fill_(255)  # and again while the commit is checked and applied
        del view
        segment.close()
        committed = raw.receive()
        assert isinstance(committed, p.WeightsCommitted), committed
    finally:
        raw.close()
    tokens, versions, version = served(client)
    assert version == before[2] + 1 and versions == [[version, 0]] and tokens != before[0]
    push_weights(client, tiny_model(seed=seed), transport="frames", timeout=10)  # the same tensors, over frames
    assert served(client)[0] == tokens


def test_a_bucket_over_shm_without_its_checksum_is_refused(worker, client):
    """The worker reuses its shared segment from one update to the next, so a raw client's bucket header sent with
    no checksum, for bytes it never wrote, would commit the last update's bytes as this update's (it did: the commit
    landed, serving the old tensors under a new version). The checksum is required over shm; the old weights serve
    on and the slot is free."""
    first = tiny_model(seed=next(SEEDS)).state_dict()
    raw = Client(worker.address)
    try:
        names, ready = open_update(raw, first, "shm", "written")
        send_buckets(raw, first, names, len(names), "shm", ready, "written")
        raw.send(p.WeightsCommit("written"))
        assert isinstance(raw.receive(), p.WeightsCommitted)
        before = served(client)
        names, ready = open_update(raw, tiny_model(seed=next(SEEDS)).state_dict(), "shm", "unwritten")
        nbytes = first[names[0]].numel() * first[names[0]].element_size()
        raw.send(p.WeightsBucket("unwritten", [p.TensorPiece(0, 0, nbytes)], None))
        refused = raw.receive()
        assert isinstance(refused, p.Error) and refused.field == "checksum", refused
        assert "required over transport shm" in refused.message, refused
    finally:
        raw.close()
    assert served(client) == before
    assert push_weights(client, tiny_model(seed=next(SEEDS)), transport="shm", timeout=10).version == before[2] + 1


def test_a_segment_attached_in_the_process_that_made_it_is_unlinked_without_a_resource_tracker_error():
    """A worker and its trainer in one process (Python < 3.13): attaching took away the creator's registration, and
    the creator's unlink then printed a KeyError traceback from the resource tracker."""
    import subprocess
    import sys

    script = (
        "from rollout.protocol.staging import StagingPool, attach_shared_memory\n"
        "pool = StagingPool()\n"
        "segment, view = pool.shared(64)\n"
        "pool.give_back(None, (segment, view))\n"
        "attach_shared_memory(segment.name).close()\n"
        "pool.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_a_bucket_over_the_workers_message_limit_fails_the_push_naming_the_limit():
    """A frame over the worker's --max-message-bytes closes the connection (ZeroMQ's MAXMSGSIZE) before the worker
    can answer: the push failed with "every worker was lost", which says nothing of the cause. Its error now names
    the limit and the push's bucket_bytes; the old weights serve on, and a push within the limit succeeds."""
    server = Worker("--max-message-bytes", "65536")
    try:
        with RolloutClient(server.address, timeout=30) as trainer:
            with pytest.raises(RolloutError) as failed:
                push_weights(trainer, tiny_model(seed=next(SEEDS)), version=2, transport="frames", timeout=20)
            assert "--max-message-bytes" in str(failed.value) and "bucket_bytes" in str(failed.value), failed.value
            # (a generate waits for the worker to be live again: the old weights serve)
            assert trainer.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0].policy_versions == [[0, 0]]
            pushed = push_weights(
                trainer, tiny_model(seed=next(SEEDS)), version=3, transport="frames", bucket_bytes=32768, timeout=20
            )
            assert pushed.version == 3
            assert trainer.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0].policy_versions == [[3, 0]]
    finally:
        server.close()

"""Top and prompt log-probs on the wire (rollout/protocol/reply_frames.py): arrays in raw frames after a reply's
header, checked against their message as a client unpacks them (a malformed entry, whatever its numbers, fails its
call naming the field, and the client goes on), padded where a distribution is smaller than k, and cut with their
tokens when a stream is resent after a failover. The values themselves are checked against a teacher-forced forward
in test_socket_logprobs.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from rollout.protocol import messages as p
from rollout.protocol.reply_frames import FrameError, pack_array, pack_top, unpack_message
from trainer_bridge import PromptGroup, RolloutClient
from trainer_bridge.client.stream_splice import splice


def result_with(frames: list[bytes], **fields) -> p.GroupResult:
    completion = p.Completion(0, [1, 2, 3], [0.0] * 3, "length", **fields)
    return p.GroupResult("g", [4, 5, 6, 7], [completion])


def scores(values: list[float], frames: list[bytes]) -> p.FrameArray:
    return pack_array(np.array(values, np.float32), "float32", frames)


def ranks(values: list[int], frames: list[bytes]) -> p.FrameArray:
    return pack_array(np.array(values, np.int32), "int32", frames)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda f: dict(zip(("top_token_ids", "top_logprobs"), pack_top([[(1, -0.5)]] * 2, f))), "2 rows for 3"),
        (
            lambda f: {"top_token_ids": pack_top([[(1, -0.5)]] * 3, f)[0]},
            "top_logprobs: shape None differs from completions\\[0\\].top_token_ids' \\[3, 1\\]",
        ),
        (lambda f: {"top_logprobs": pack_top([[(1, -0.5)]] * 3, f)[0]}, "dtype 'int32'"),
        (
            lambda f: {
                "prompt_logprobs": scores([-1.0] * 3, f),
                "prompt_logprob_ranks": ranks([1] * 3, f),
                **dict(zip(("prompt_top_token_ids", "prompt_top_logprobs"), pack_top([[(1, -0.5)]] * 2, f))),
            },
            "prompt_top_token_ids: 2 rows for 3 positions",
        ),
        (lambda f: {"prompt_logprobs": scores([-1.0], f), "prompt_logprob_ranks": ranks([1], f)}, "1 values for 3"),
        (lambda f: {"prompt_logprobs": scores([-1.0] * 3, f), "prompt_logprob_ranks": ranks([1], f)}, "1 ranks for 3"),
        (lambda f: {"prompt_logprobs": scores([-1.0] * 3, f)}, "no ranks for 3"),
        (lambda f: {"prompt_logprobs": scores([-1.0] * 3, f), "prompt_logprob_ranks": ranks([1, 0, 1], f)}, "below 1"),
        (lambda f: {"prompt_logprob_ranks": ranks([1, 1, 1], f)}, "prompt_logprob_ranks: given without"),
        (lambda f: {"prompt_logprobs": ranks([1, 1, 1], f)}, "dtype 'int32'"),
    ],
    ids=[
        "rows",
        "ids-alone",
        "dtype",
        "prompt-rows",
        "scores",
        "ranks",
        "no-ranks",
        "rank-0",
        "ranks-alone",
        "score-dtype",
    ],
)
def test_frames_that_do_not_fit_their_message_are_refused_by_name(build, message):
    frames: list[bytes] = []
    result = result_with(frames, **build(frames))
    with pytest.raises(FrameError, match=message) as refused:
        unpack_message(result, frames)
    assert refused.value.field.startswith("completions[0].")


@pytest.mark.parametrize("shape", [[0, 2**63], [2**62, 0], [0, 2**70]])
def test_an_empty_shape_numpy_cannot_make_is_refused_by_name(shape):
    """Zero bytes hold any shape with a 0 in it, but numpy makes none past its dimension limits: its plain ValueError
    ended the client's I/O thread (every later call "closed")."""
    entries = {"top_token_ids": p.FrameArray(0, shape, "int32"), "top_logprobs": p.FrameArray(1, shape, "float32")}
    completion = p.Completion(0, [], [], "length", **entries)
    with pytest.raises(FrameError, match="shape") as refused:
        unpack_message(p.GroupResult("g", [1], [completion]), [b"", b""])
    assert refused.value.field == "completions[0].top_token_ids"


def test_a_distribution_smaller_than_k_is_padded_not_shifted():
    frames: list[bytes] = []
    ids, logprobs = pack_top([[(3, -0.1), (4, -2.0)], [(5, -0.3)]], frames)
    completion = p.Completion(0, [3, 5], [-0.1, -0.3], "length", top_token_ids=ids, top_logprobs=logprobs)
    unpack_message(p.GroupResult("g", [1], [completion]), frames)
    assert completion.top_token_ids.tolist() == [[3, 4], [5, -1]]
    assert completion.top_logprobs[1, 0] == np.float32(-0.3) and np.isnan(completion.top_logprobs[1, 1])


def test_a_stream_resent_after_a_failover_cuts_its_arrays_with_its_tokens():
    """The new worker streams from token 0 again: the caller gets only the tokens it lacks, each with its own rows,
    and the prompt's fields once per sample (not again with the resent first delta)."""
    call = SimpleNamespace(received={}, delivered={}, group=SimpleNamespace(group_id="mine"))

    def received(tokens: list[int]) -> p.Delta:
        frames: list[bytes] = []
        delta = p.Delta("wire", 0, tokens, [-float(token) for token in tokens], 0)
        delta.top_token_ids, delta.top_logprobs = pack_top([[(token, -float(token))] for token in tokens], frames)
        if tokens[0] == 7:  # a sample's first delta from its worker: the prompt's scores
            delta.prompt_logprobs = pack_array(np.array([-1.5], np.float32), "float32", frames)
            delta.prompt_logprob_ranks = pack_array(np.array([2], np.int32), "int32", frames)
        unpack_message(delta, frames)
        return delta

    first = splice(call, received([7, 8, 9]))
    assert first.prompt_logprobs.tolist() == [-1.5] and first.top_token_ids.tolist() == [[7], [8], [9]]
    call.received = {}  # failed over (liveness.py): the next worker resends the sample from its first token
    delta = splice(call, received([7, 8, 9, 10, 11]))
    assert delta.group_id == "mine" and delta.token_ids == [10, 11] and delta.logprobs == [-10.0, -11.0]
    assert delta.top_token_ids.tolist() == [[10], [11]] and delta.top_logprobs.tolist() == [[-10.0], [-11.0]]
    assert delta.prompt_logprobs is None  # the caller has them from its first delta
    assert splice(call, received([12])).prompt_logprobs is None and call.delivered[0] == 6


def test_replies_a_client_cannot_read_fail_their_call_by_name_and_the_client_goes_on(tmp_path):
    """A fake worker's answers: a [2**32, 2**32] int32 array over an empty frame (numpy's product wraps to 0 bytes,
    which the frame holds: the reshape raised a plain ValueError that ended the client's I/O thread, every later
    call "closed"), then a header that does not decode (a completion's token ids a string: the client dropped it and
    the call waited for its timeout); each call fails naming the field, the worker is told to cancel its group (it
    would go on generating what nobody reads), and the next call is answered."""
    import threading

    import msgpack
    import zmq

    from rollout.protocol import codec
    from trainer_bridge import RolloutError

    address, stop, sent, cancelled = f"ipc://{tmp_path}/worker", threading.Event(), [], []
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(address)

    def answer(message: p.Generate, answered: int) -> list[bytes]:
        shape = [2**32, 2**32] if answered == 0 else [1, 1]
        entries = {"top_token_ids": p.FrameArray(0, shape, "int32"), "top_logprobs": p.FrameArray(1, shape, "float32")}
        completion = p.Completion(0, [1], [-0.5], "length", **entries)
        header = codec.encode(p.GroupResult(message.group_id, message.prompt_ids, [completion]))
        if answered == 1:
            plain = msgpack.unpackb(header[0])
            plain["completions"][0]["token_ids"] = "x"
            header = [msgpack.packb(plain)]
        data = [b"", b""] if answered == 0 else [np.int32(1).tobytes(), np.float32(-0.5).tobytes()]
        return [*header, *data]

    def serve() -> None:
        answered = 0
        while not stop.is_set():
            if not router.poll(20):
                continue
            identity, *frames = router.recv_multipart()
            message = codec.decode(frames)
            if isinstance(message, p.Ping):
                router.send_multipart([identity, *codec.encode(p.Pong(message.nonce, 0))])
            elif isinstance(message, p.Cancel):
                cancelled.append(message.group_id)
            elif isinstance(message, p.Generate):
                sent.append(message.group_id)
                router.send_multipart([identity, *answer(message, answered)])
                answered += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    group = PromptGroup([1, 2], 1, {"max_new_tokens": 1, "top_logprobs": 1})
    try:
        with RolloutClient([address], timeout=10) as client:
            with pytest.raises(RolloutError, match=r"completions\[0\]\.top_token_ids: 0 bytes do not hold") as failed:
                client.generate(group)
            assert failed.value.code == "bad_reply" and failed.value.field == "completions[0].top_token_ids"
            started = time.monotonic()
            with pytest.raises(RolloutError, match=r"could not be read.*expected a list") as failed:
                client.generate(group)
            assert failed.value.code == "bad_reply" and failed.value.field == "completions[0].token_ids"
            assert time.monotonic() - started < 5  # answered, not timed out
            assert client.generate(group).completions[0].top_token_ids.tolist() == [[1]]
            assert cancelled == sent[:2]  # (sent before the next call's generate)
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)

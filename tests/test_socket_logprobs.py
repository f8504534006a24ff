"""Top log-probs (`top_logprobs`) and prompt log-probs (`prompt_logprobs`) over the ZeroMQ socket and from a
`ColocatedEngine`: every value against a teacher-forced transformers forward of the worker's own model (fp32
log_softmax of `model(ids).logits`), streamed deltas against the final result, and malformed frames refused by name.

References we did not write: transformers' forward of `tiny_model(0)`, the weights the session's worker serves."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError
from rollout.presets import tiny_model
from rollout.protocol import messages as p
from rollout.protocol.reply_frames import FrameError, pack_array, pack_top, unpack_message
from trainer_bridge import ColocatedEngine, PromptGroup, RolloutClient, RolloutError
from trainer_bridge.client.stream_splice import splice

PROMPT = [5, 9, 14, 3, 7, 22, 8]
TOP, PROMPT_TOP = 5, 3
SAMPLING = {
    "temperature": 1.0,
    "seed": 11,
    "max_new_tokens": 8,
    "stop_token_ids": [],
    "top_logprobs": TOP,
    "prompt_logprobs": PROMPT_TOP,
}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def worker(http_worker):
    return http_worker  # the session's worker on tiny_model(0) (nothing here changes its weights)


@pytest.fixture(scope="module")
def reference():
    return tiny_model(0)


def teacher_forced(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab) fp32 log-probs: row i the distribution of token i + 1, from one forward over `ids`."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)


def check_top(ids: np.ndarray, logprobs: np.ndarray, expected: torch.Tensor, k: int) -> None:
    """Each row's k values are the distribution's k largest, most likely first, and each id's log-prob is its value
    (ties may order their ids either way)."""
    assert ids.shape == logprobs.shape == (len(expected), k) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    values = torch.from_numpy(logprobs.copy())
    assert torch.allclose(values, expected.topk(k, -1).values, atol=TOLERANCE)
    assert torch.allclose(expected.gather(1, torch.from_numpy(ids.astype(np.int64))), values, atol=TOLERANCE)


def check_completion(model: torch.nn.Module, completion) -> None:
    """A completion's token, top and prompt log-probs against the teacher-forced forward of prompt + completion."""
    expected = teacher_forced(model, PROMPT + completion.token_ids)
    generated = expected[len(PROMPT) - 1 :]
    chosen = generated.gather(1, torch.tensor(completion.token_ids).unsqueeze(1))[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), chosen, atol=TOLERANCE)
    check_top(completion.top_token_ids, completion.top_logprobs, generated, TOP)
    prompt = expected[: len(PROMPT) - 1]
    assert completion.prompt_logprobs.shape == completion.prompt_logprob_ranks.shape == (len(PROMPT) - 1,)
    assert completion.prompt_logprobs.dtype == np.float32 and completion.prompt_logprob_ranks.dtype == np.int32
    prompt_chosen = prompt.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))[:, 0]
    assert torch.allclose(torch.tensor(completion.prompt_logprobs), prompt_chosen, atol=TOLERANCE)
    for rank, row, value in zip(completion.prompt_logprob_ranks.tolist(), prompt, prompt_chosen):  # 1 + those above
        assert int((row > value + TOLERANCE).sum()) + 1 <= rank <= int((row > value - TOLERANCE).sum()) + 1
    check_top(completion.prompt_top_token_ids, completion.prompt_top_logprobs, prompt, PROMPT_TOP)


def test_a_workers_top_and_prompt_logprobs_equal_a_teacher_forced_forward(worker, reference):
    with RolloutClient(worker.address) as client:
        result = client.generate(PromptGroup(PROMPT, 3, SAMPLING, "scored"), timeout=60)
    assert len(result.completions) == 3
    for completion in result.completions:
        assert len(completion.token_ids) == 8
        check_completion(reference, completion)


def test_streamed_deltas_carry_the_same_values_as_the_result(worker, reference):
    """Each sample's deltas, joined, equal its completion; the prompt's fields come on its first delta only."""
    with RolloutClient(worker.address) as client:
        events = list(client.stream(PromptGroup(PROMPT, 2, SAMPLING, "streamed"), timeout=60))
    result = events[-1]
    deltas = [event for event in events[:-1] if isinstance(event, p.Delta)]
    for completion in result.completions:
        mine = [delta for delta in deltas if delta.sample_index == completion.sample_index]
        assert sum((delta.token_ids for delta in mine), []) == completion.token_ids
        np.testing.assert_array_equal(np.concatenate([d.top_token_ids for d in mine]), completion.top_token_ids)
        np.testing.assert_array_equal(np.concatenate([d.top_logprobs for d in mine]), completion.top_logprobs)
        np.testing.assert_array_equal(mine[0].prompt_logprobs, completion.prompt_logprobs)
        np.testing.assert_array_equal(mine[0].prompt_logprob_ranks, completion.prompt_logprob_ranks)
        np.testing.assert_array_equal(mine[0].prompt_top_logprobs, completion.prompt_top_logprobs)
        assert all(delta.prompt_logprobs is None and delta.prompt_top_token_ids is None for delta in mine[1:])
        check_completion(reference, completion)


def test_a_colocated_round_carries_them_as_a_worker_does(worker):
    """The same weights, prompt and seed colocated: the same tokens, and the same arrays as the worker's."""
    group = PromptGroup(PROMPT, 2, SAMPLING, "colocated")
    with RolloutClient(worker.address) as client:
        served = client.generate(group, timeout=60)
    with ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(num_blocks=64, block_size=16)) as engine:
        (colocated,) = engine.generate([group])
    for ours, theirs in zip(colocated.completions, served.completions):
        assert ours.token_ids == theirs.token_ids
        np.testing.assert_array_equal(ours.top_token_ids, theirs.top_token_ids)
        np.testing.assert_allclose(ours.top_logprobs, theirs.top_logprobs, atol=TOLERANCE)
        np.testing.assert_allclose(ours.prompt_logprobs, theirs.prompt_logprobs, atol=TOLERANCE)
        np.testing.assert_array_equal(ours.prompt_top_token_ids, theirs.prompt_top_token_ids)


def test_a_group_result_carries_its_prompts_arrays_once(reference):
    """The engine scores a group's prompt once; its result names one pair of prompt frames from every completion
    (n copies made 64 x 8k-token prompts at k=20 cost 80 MiB and 1.3 s of the engine thread), read back the same."""
    from rollout.config import SamplingParams
    from rollout.engine.engine import Engine
    from rollout.protocol import codec
    from rollout.protocol.group_folding import GroupInFlight

    engine = Engine(tiny_model(0), ContinuousBatchingConfig(num_blocks=64, block_size=16))
    engine.add_request("g", PROMPT, SamplingParams(**SAMPLING), n=4)
    group, result = GroupInFlight(b"", "g", PROMPT, 4, False), None
    while result is None:
        for output in engine.step():
            result = group.absorb(output, engine.policy_version)[1] or result
    engine.close()
    assert len(result.data_frames) == 4 * 2 + 4  # each sample's top ids and log-probs, the prompt's four once
    frames = codec.encode(result)
    received = codec.decode(frames)
    unpack_message(received, frames[1:])
    for completion in received.completions:
        check_completion(reference, completion)


def test_k_zero_sends_no_arrays_and_plain_groups_none_at_all(worker):
    """prompt_logprobs=0: the prompt tokens' own log-probs, no top arrays; without either field, nothing extra."""
    with RolloutClient(worker.address) as client:
        scored = client.generate(PromptGroup(PROMPT, 1, {**SAMPLING, "prompt_logprobs": 0, "top_logprobs": 0}))
        plain = client.generate(PromptGroup(PROMPT, 1, {"max_new_tokens": 4, "stop_token_ids": []}))
    (completion,) = scored.completions
    assert completion.prompt_logprobs.shape == (len(PROMPT) - 1,) and completion.prompt_top_token_ids is None
    assert completion.top_token_ids is None and completion.top_logprobs is None
    (completion,) = plain.completions
    assert completion.prompt_logprobs is None and completion.top_logprobs is None


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


def test_scoring_a_completion_with_max_new_tokens_0_gives_its_sampled_logprobs(worker):
    """The docs' distillation recipe: a group of prompt + completion with max_new_tokens=0 scores the completion's
    tokens as their sampling did where that changed nothing (temperature 1, no top-k, top-p or penalty set)."""
    sampling = {"max_new_tokens": 8, "stop_token_ids": [], "top_logprobs": 5, "prompt_logprobs": 2}
    with RolloutClient(worker.address) as client:
        completion = client.generate(PromptGroup(PROMPT, 1, sampling)).completions[0]
        scoring = {"max_new_tokens": 0, "prompt_logprobs": 0}
        scored = client.generate(PromptGroup(PROMPT + completion.token_ids, 1, scoring)).completions[0]
    assert scored.token_ids == [] and scored.finish_reason == "length"
    rescored = torch.from_numpy(scored.prompt_logprobs[len(PROMPT) - 1 :].copy())
    assert torch.allclose(rescored, torch.tensor(completion.logprobs), atol=TOLERANCE)


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
    the call waited for its timeout); each call fails naming the field, and the next call is answered."""
    import threading

    import msgpack
    import zmq

    from rollout.protocol import codec
    from trainer_bridge import RolloutError

    address, stop = f"ipc://{tmp_path}/worker", threading.Event()
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
            elif isinstance(message, p.Generate):
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
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)


def test_more_top_logprobs_than_a_worker_serves_are_refused_by_name_colocated_too(worker):
    """vLLM's max_logprobs (20), over ZeroMQ as over HTTP; a ColocatedEngine refuses what a worker refuses."""
    group = PromptGroup(PROMPT, 1, {**SAMPLING, "top_logprobs": 21})
    with RolloutClient(worker.address) as client:
        with pytest.raises(RolloutError, match="at most 20") as remote:
            client.generate(group, timeout=30)
    assert remote.value.code == "bad_request" and remote.value.field == "sampling.top_logprobs"
    with ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(num_blocks=64, block_size=16)) as engine:
        with pytest.raises(FieldError, match="at most 20") as local:
            engine.generate([group])
    assert local.value.field == "groups[0].sampling.top_logprobs"

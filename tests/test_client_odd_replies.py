"""A worker's reply that does not fit the group it answers fails the call naming the field, instead of reaching the
trainer as a silently wrong group: a result of no samples for n=1 (a GRPO group whose advantages are NaN), samples
out of order, a sample's tokens without their log-probs, a finish reason the protocol does not have, another
prompt, a delta of a sample the group does not have. The client serves on: the next call is answered."""

from __future__ import annotations

import threading

import pytest
import zmq

from rollout import protocol as p
from rollout.protocol import codec
from trainer_bridge import PromptGroup, RolloutClient, RolloutError

pytestmark = pytest.mark.timeout(60)
PROMPT = [1, 2]


def _completion(index: int = 0, tokens: tuple = (7,), reason: str = "stop") -> p.Completion:
    return p.Completion(index, list(tokens), [-0.5] * len(tokens), reason)


ODD = {
    "completions": lambda g: [p.GroupResult(g, PROMPT, [])],
    "completions[0].sample_index": lambda g: [p.GroupResult(g, PROMPT, [_completion(5)])],
    "completions[0].logprobs": lambda g: [p.GroupResult(g, PROMPT, [p.Completion(0, [7, 8], [-0.5], "stop")])],
    "completions[0].finish_reason": lambda g: [p.GroupResult(g, PROMPT, [_completion(reason="weird")])],
    "prompt_ids": lambda g: [p.GroupResult(g, [9, 9], [_completion()])],
    "sample_index": lambda g: [p.Delta(g, 7, [7], [-0.5], 0), p.GroupResult(g, PROMPT, [_completion()])],
}


def test_replies_that_do_not_fit_their_group_fail_the_call_by_name(tmp_path):
    address, stop, cancelled = f"ipc://{tmp_path}/worker", threading.Event(), []
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(address)
    answers: list = []

    def serve() -> None:
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
                replies = (
                    answers.pop(0)(message.group_id)
                    if answers
                    else [p.GroupResult(message.group_id, PROMPT, [_completion()])]
                )
                for reply in replies:
                    router.send_multipart([identity, *codec.encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    group = PromptGroup(PROMPT, 1, {"max_new_tokens": 1})
    try:
        with RolloutClient([address], timeout=10) as client:
            for field, odd in ODD.items():
                answers.append(odd)
                with pytest.raises(RolloutError, match="does not fit the group") as failed:
                    client.generate(group)
                assert (failed.value.code, failed.value.field) == ("bad_reply", field), failed.value
            assert client.generate(group).completions[0].token_ids == [7]  # a reply that fits: served as ever
        assert len(cancelled) == len(ODD)  # each failed group is cancelled on its worker (a no-op once it ended)
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)

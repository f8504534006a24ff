"""Top log-probs (`top_logprobs`) and prompt log-probs (`prompt_logprobs`) over the ZeroMQ socket and from a
`ColocatedEngine`: every value against a teacher-forced transformers forward of the worker's own model (fp32
log_softmax of `model(ids).logits`), streamed deltas against the final result, a worker's limit refused by name (the
wire's own checks: test_reply_frames.py).

References we did not write: transformers' forward of `tiny_model(0)`, the weights the session's worker serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError
from rollout.presets import tiny_model
from rollout.protocol import messages as p
from rollout.protocol.reply_frames import unpack_message
from trainer_bridge import ColocatedEngine, PromptGroup, RolloutClient, RolloutError

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


def test_a_greedy_group_with_temperature_scaled_logprobs_is_served_at_its_temperature(worker, reference):
    """`SamplingParams(do_sample=False, temperature=0.5, logprob_mode="temperature_scaled")` picks the argmax and
    scales its log-probs by the temperature in process (documented); over the wire the same settings were refused as
    "temperature has no effect while do_sample is False". Against transformers' greedy `generate` and
    log_softmax(logits / 0.5) of a teacher-forced forward."""
    from transformers import GenerationConfig

    from rollout.config import SamplingParams

    sampling = SamplingParams(
        do_sample=False, temperature=0.5, logprob_mode="temperature_scaled", max_new_tokens=6, stop_token_ids=()
    )
    with RolloutClient(worker.address) as client:
        (completion,) = client.generate(PromptGroup(PROMPT, 1, sampling), timeout=60).completions
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    greedy = reference.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT) :].tolist()
    assert completion.token_ids == greedy
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + greedy])).logits[0, len(PROMPT) - 1 : -1].float()
    scaled = torch.log_softmax(logits / 0.5, -1).gather(1, torch.tensor(greedy).unsqueeze(1))[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), scaled, atol=TOLERANCE)

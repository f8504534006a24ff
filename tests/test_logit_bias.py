"""`SamplingParams.logit_bias` (OpenAI / vLLM semantics) against transformers' own `SequenceBiasLogitsProcessor`
(single-token sequences): greedy tokens equal `generate(..., sequence_bias=...)`, "processed" log-probs equal
log_softmax of transformers' processors applied after the bias to a teacher-forced forward, "raw" and
"temperature_scaled" leave the bias out; +/-100 force / ban a token; rows with different biases (and none) share a
batch; bad biases are refused naming logit_bias; the field crosses the ZeroMQ protocol."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from test_sampling import processed_scores, reference_generate, reference_logits
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from conftest import VOCAB, make_engine, make_prompts, make_request, reference_copy, run_to_completion, tiny_model
from rollout import protocol as p
from rollout.config import FieldError, SamplingParams
from rollout.engine.generate import generate_batch
from rollout.engine.sampling.slots import SamplingSlots
from rollout.validation import MAX_LOGIT_BIAS_TOKENS
from trainer_bridge.client.calls import PromptGroup, checked_group

MAX_NEW = 6
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    model = tiny_model("qwen3")
    return model, reference_copy(model)


def pad_free_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts without token 0: `reference_generate`'s pad token, which `generate` would mask out of a prompt."""
    return [[token or 1 for token in prompt] for prompt in make_prompts(count, 4, 12, seed=seed)]


def favourites(reference: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """The `count` tokens the model likes best after `prompt` (what a bias should move)."""
    return reference_logits(reference, prompt, [0])[0].topk(count).indices.tolist()


def biased(logits: torch.Tensor, prompt: list[int], previous: list[int], params: SamplingParams) -> torch.Tensor:
    """One position's logits through transformers' SequenceBiasLogitsProcessor (when the request sets a bias),
    then transformers' other processors in the sampler's documented order."""
    if params.logit_bias:
        bias = SequenceBiasLogitsProcessor([[[token], bias] for token, bias in params.logit_bias])
        logits = bias(torch.tensor([prompt + previous]), logits.unsqueeze(0).clone())[0]
    return processed_scores(logits, prompt, previous, params)


def check_logprobs(reference, prompt: list[int], out, params: SamplingParams, where: str) -> None:
    """The completion's log-probs (and top log-probs) are those of the request's logprob_mode, computed by
    transformers on a teacher-forced forward of the reference copy."""
    tokens = out.generated_tokens
    logits = reference_logits(reference, prompt, tokens)
    for t, token in enumerate(tokens):
        if params.logprob_mode == "processed":
            row = torch.log_softmax(biased(logits[t], prompt, tokens[:t], params), dim=-1)
        else:
            divisor = params.temperature if params.logprob_mode == "temperature_scaled" and params.temperature else 1
            row = torch.log_softmax(logits[t] / divisor, dim=-1)  # the bias left out
        expected = row[token].item()
        assert math.isfinite(expected) and abs(out.logprobs[t] - expected) <= TOL, (where, t, out.logprobs[t], expected)
        for top_token, value in out.top_logprobs[t] if params.top_logprobs else ():
            assert abs(value - row[top_token].item()) <= TOL, (where, t, top_token)


def test_greedy_with_bias_matches_generate_with_sequence_bias(models):
    """Greedy rows with biases (one with a repetition penalty, which sees the biased logits) and one without share
    a batch; each gives `generate(..., sequence_bias=...)`'s tokens, and the biases change what is generated."""
    model, reference = models
    prompts = pad_free_prompts(3, 5)
    up, down = favourites(reference, prompts[0], 3)[2], favourites(reference, prompts[1], 1)[0]
    requests = {
        "up": SamplingParams(temperature=0, logit_bias={up: 6.0, down: -3.0}),
        # Biases on prompt tokens: the repetition penalty divides (or multiplies) their biased logits.
        "penalized": SamplingParams(
            temperature=0, logit_bias={down: -8.0, **dict.fromkeys(prompts[1][:4], 4.0)}, repetition_penalty=1.5
        ),
        "none": SamplingParams(temperature=0),
    }
    engine = make_engine(model)
    for (name, params), prompt in zip(requests.items(), prompts):
        engine.add_request(name, prompt, params.merged(stop_token_ids=()), max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    changed = 0
    for (name, params), prompt in zip(requests.items(), prompts):
        kwargs = {"repetition_penalty": params.repetition_penalty} if params.repetition_penalty != 1 else {}
        if params.logit_bias:
            kwargs["sequence_bias"] = [[[token], bias] for token, bias in params.logit_bias]
            changed += outputs[name].generated_tokens != reference_generate(reference, prompt, MAX_NEW)
        expected = reference_generate(reference, prompt, MAX_NEW, **kwargs)
        assert outputs[name].generated_tokens == expected, name
    assert changed == 2, "each bias should change its greedy completion"
    assert engine.sampler.slots.bias.tokens is None, "the bias tables outlive their samples"


def test_mixed_batch_each_row_gets_its_own_bias_and_logprobs(models):
    """Sampled rows with different biases, and rows without, mixed with top_k, top_p, min_p and penalties, in
    groups of two, in every logprob_mode: each row's log-probs are its own reference's ("processed": transformers'
    processors after SequenceBiasLogitsProcessor; "raw" and "temperature_scaled": without the bias)."""
    model, reference = models
    prompts = pad_free_prompts(6, 6)
    likes = favourites(reference, prompts[0], 4)
    requests = {
        "top_k": SamplingParams(temperature=0.9, top_k=8, logit_bias={likes[3]: 4.0, likes[0]: -2.0}),
        "penalties": SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, logit_bias={3: 5.0, 9: -1.5}),
        "none": SamplingParams(temperature=0.8, top_p=0.9),
        "raw": SamplingParams(min_p=0.05, logit_bias={likes[1]: 20.0}, logprob_mode="raw"),
        "scaled": SamplingParams(temperature=0.7, logit_bias={likes[2]: -4.0}, logprob_mode="temperature_scaled"),
        "greedy": SamplingParams(temperature=0, frequency_penalty=0.4, logit_bias={11: 3.0}),
    }
    engine = make_engine(model, return_logprobs=True)
    for (name, params), prompt in zip(requests.items(), prompts):
        params = params.merged(stop_token_ids=(), top_logprobs=3, seed=len(name))
        engine.add_request(name, prompt, params, n=2, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    assert len(outputs) == 2 * len(requests)
    for (name, params), prompt in zip(requests.items(), prompts):
        params = params.merged(top_logprobs=3)
        for index in range(2):
            check_logprobs(reference, prompt, outputs[f"{name}#{index}"], params, f"{name}#{index}")
    assert engine.sampler.slots.bias.tokens is None


def test_plus_100_forces_and_minus_100_bans_a_token(models):
    """At temperature 1, a +100 bias makes its token the only one drawn, and -100 biases on the tokens the model
    draws most never let them be drawn, over many seeds."""
    model, reference = models
    prompt = make_prompts(1, 6, 6, seed=7)[0]
    engine = make_engine(model)
    plain = SamplingParams(temperature=1.0, stop_token_ids=(), seed=1)
    engine.add_request("plain", prompt, plain, n=16, max_new_tokens=4)
    drawn = [t for out in run_to_completion(engine).values() for t in out.generated_tokens]
    banned = sorted(set(drawn), key=drawn.count)[-4:]
    engine.add_request("forced", prompt, plain.merged(logit_bias={200: 100.0}), n=16, max_new_tokens=4)
    engine.add_request("banned", prompt, plain.merged(logit_bias=dict.fromkeys(banned, -100.0)), n=16, max_new_tokens=4)
    outputs = run_to_completion(engine)
    forced = [t for name, out in outputs.items() if name.startswith("forced") for t in out.generated_tokens]
    after = [t for name, out in outputs.items() if name.startswith("banned") for t in out.generated_tokens]
    assert forced == [200] * 64
    assert len(after) == 64 and not set(after) & set(banned), (banned, after)


def test_slot_rows_follow_their_samples_through_reuse_and_growth():
    """A slot freed by a biased sample and taken by one without bias holds no bias; the tables widen for a longer
    bias and grow with the slots, keeping every live row."""
    slots = SamplingSlots(VOCAB, torch.device("cpu"), capacity=2)
    first = make_request("a", [1, 2], logit_bias={5: 1.0})
    second = make_request("b", [1, 2], logit_bias={6: -2.0, 7: 3.0})
    slots.gather([first, second])
    slots.release(first)
    plain, wide = make_request("c", [1, 2]), make_request("d", [1], logit_bias={i: 0.5 for i in range(10, 20)})
    columns = slots.gather([second, plain, wide])  # `plain` takes `first`'s slot; `wide` grows the tables
    rows = slots.bias.apply(torch.zeros(3, VOCAB), columns)
    expected = torch.zeros(3, VOCAB)
    expected[0, 6], expected[0, 7], expected[2, 10:20] = -2.0, 3.0, 0.5
    assert torch.equal(rows, expected)
    for request in (second, plain, wide):
        slots.release(request)
    assert slots.bias.tokens is None and not slots.any("logit_bias")


@pytest.mark.parametrize(
    "value",
    [
        {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)},
        {5: float("nan")},
        {5: float("inf")},
        {5: 100.5},
        {5: -101},
        {5: True},
        {True: 1.0},
        {-1: 1.0},
        {"-1": 1.0},
        {"12a": 1.0},
        [[5, 1.0], [5, 2.0]],
        [[5]],
        "5",
    ],
)
def test_bad_biases_are_refused_naming_logit_bias(value):
    with pytest.raises(FieldError) as error:
        SamplingParams(logit_bias=value)
    assert error.value.field == "logit_bias"
    with pytest.raises(FieldError) as error:
        SamplingParams.from_fields({"logit_bias": value})
    assert error.value.field == "sampling.logit_bias"


def test_forms_are_canonical_and_the_vocabulary_bounds_token_ids(models):
    """A map with int or digit-string keys (JSON's) and a list of pairs give the same sorted pairs; 300 tokens are
    accepted; a token id past the vocabulary is refused by the engine, naming logit_bias."""
    expected = ((3, 1.0), (12, -2.5))
    for value in ({12: -2.5, 3: 1}, {"12": -2.5, "3": 1.0}, [[12, -2.5], (3, 1.0)]):
        assert SamplingParams(logit_bias=value).logit_bias == expected
    assert SamplingParams(logit_bias=None).logit_bias == SamplingParams(logit_bias={}).logit_bias == ()
    many = SamplingParams(logit_bias={i: -1.0 for i in range(MAX_LOGIT_BIAS_TOKENS)})
    assert len(many.logit_bias) == MAX_LOGIT_BIAS_TOKENS
    model, _ = models
    for token in (VOCAB, VOCAB + 10**6):
        params = SamplingParams(temperature=0, logit_bias={1: 1.0, token: 2.0})
        with pytest.raises(FieldError) as error:
            generate_batch(model, [[1, 2, 3]], sampling=params, max_new_tokens=2, progress_bar=False, warmup=False)
        assert error.value.field == "logit_bias" and str(VOCAB) in error.value.reason


def test_logit_bias_round_trips_over_zeromq():
    """SamplingParams -> the generate message's `sampling` map -> msgpack frames -> SamplingParams again; a
    trainer's dict with int (or numpy) keys travels as pairs, since the worker decodes only string-keyed maps."""
    params = SamplingParams(temperature=0.5, logit_bias={7: -1.5, "3": 100})
    message = p.decode(p.encode(p.Generate("g", [1, 2], 1, params.changed_fields())))
    assert SamplingParams.from_fields(message.sampling) == params
    group = checked_group(PromptGroup([1, 2], 1, {"logit_bias": {torch.tensor(7): 1.5, 3: -2}}), lambda: 1, lambda: "g")
    assert group.sampling["logit_bias"] == [[3, -2.0], [7, 1.5]]
    message = p.decode(p.encode(p.Generate("g", [1, 2], 1, group.sampling)))
    assert SamplingParams.from_fields(message.sampling).logit_bias == ((3, -2.0), (7, 1.5))
    with pytest.raises(p.ProtocolError):  # why the pairs: an int-keyed map is refused by the worker's decoder
        p.decode([msgpack.packb({"protocol": p.PROTOCOL_VERSION, "type": "generate", "group_id": "g",
                                 "prompt_ids": [1], "sampling": {"logit_bias": {7: 1.0}}})])  # fmt: skip

"""Sampling against transformers itself: processed/raw log-probs of sampled tokens (teacher-forced forward of an
independent copy + transformers' own logits processors in the documented order), greedy parity with `generate`,
per-request seeds (alone, in a mixed batch, under preemption, in groups; global RNG untouched) and stop tokens."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from conftest import VOCAB, make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.engine.engine import Engine

KINDS = ["qwen3", "mistral_sliding"]
MAX_NEW = 12
TOL = 1e-5
# Every 4th token id: stops are frequent enough that min_new_tokens has something to mask.
MANY_STOPS = tuple(range(0, VOCAB, 4))

# Each case runs 4 prompts; top_logprobs is on everywhere so its consistency is checked in every mode.
LOGPROB_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=0.9, top_k=5),
    "top_p": SamplingParams(top_p=0.6),
    "min_p": SamplingParams(temperature=1.3, min_p=0.2),
    "repetition": SamplingParams(temperature=0.8, repetition_penalty=1.6),
    "repetition_below_one": SamplingParams(repetition_penalty=0.7),
    "presence_frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
    # A negative frequency penalty makes repeats likely, so counts above 1 are exercised.
    "frequency_repeats": SamplingParams(temperature=0.7, presence_penalty=0.2, frequency_penalty=-1.0),
    "min_new_tokens_with_stops": SamplingParams(min_new_tokens=8, stop_token_ids=MANY_STOPS),
    "combined": SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_new_tokens=4,
        stop_token_ids=MANY_STOPS,
    ),
    # Every token already seen is banned (n = 1), so bans happen at every step.
    "no_repeat_unigram": SamplingParams(temperature=0.9, no_repeat_ngram_size=1),
    "bans": SamplingParams(
        temperature=0.8,
        no_repeat_ngram_size=2,
        bad_words_ids=((3,), (5, 7), (9, 11, 13), (4,)),
        suppress_tokens=(1, 2),
        begin_suppress_tokens=(6, 8),
        stop_token_ids=(4,),  # transformers keeps a single-token bad word that is a stop token
    ),
    "typical": SamplingParams(typical_p=0.6),
    "epsilon": SamplingParams(temperature=1.2, epsilon_cutoff=0.01),
    "eta": SamplingParams(eta_cutoff=0.05),
    "greedy_bans": SamplingParams(temperature=0, no_repeat_ngram_size=1, suppress_tokens=(0,)),
    "greedy_penalized": SamplingParams(
        temperature=0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        min_new_tokens=4,
        stop_token_ids=MANY_STOPS,
    ),
}


# ---- references built from transformers ---------------------------------------------------------------------------
def reference_logits(reference: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Teacher-forced fp32 logits of the reference copy at every generated position: (len(completion), vocab)."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def processed_scores(
    scores: torch.Tensor, prompt: list[int], previous: list[int], params: SamplingParams
) -> torch.Tensor:
    """One position's logits (vocab,) through transformers' processors in the documented pipeline order.

    Presence/frequency penalties have no transformers processor: they are the OpenAI formula over generated tokens.
    """
    input_ids = torch.tensor([prompt + previous])
    scores = scores.unsqueeze(0).clone()
    if params.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    counts = torch.bincount(torch.tensor(previous, dtype=torch.long), minlength=scores.shape[-1]).float()
    scores = scores - params.presence_penalty * (counts > 0).float() - params.frequency_penalty * counts
    if params.no_repeat_ngram_size:
        scores = NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size)(input_ids, scores)
    if params.bad_words_ids:
        stops = list(params.stop_token_ids or ()) or None
        scores = NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], stops)(input_ids, scores)
    if params.suppress_tokens:
        scores = SuppressTokensLogitsProcessor(list(params.suppress_tokens))(input_ids, scores)
    if params.begin_suppress_tokens:
        scores = SuppressTokensAtBeginLogitsProcessor(list(params.begin_suppress_tokens), len(prompt))(
            input_ids, scores
        )
    if params.min_new_tokens and params.stop_token_ids:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_new_tokens, list(params.stop_token_ids))(
            input_ids, scores
        )
    if not params.greedy:  # temperature and truncation do not change a greedy row's argmax (documented)
        warpers = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            warpers.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0:
            warpers.append(MinPLogitsWarper(params.min_p))
        if params.typical_p < 1:
            warpers.append(TypicalLogitsWarper(params.typical_p))
        if params.epsilon_cutoff > 0:
            warpers.append(EpsilonLogitsWarper(params.epsilon_cutoff))
        if params.eta_cutoff > 0:
            warpers.append(EtaLogitsWarper(params.eta_cutoff))
        for warper in warpers:
            scores = warper(input_ids, scores)
    return scores[0]


def expected_logprobs(
    reference: torch.nn.Module, prompt: list[int], completion: list[int], params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, processed) fp32 log-prob rows, (len(completion), vocab), for a completion the engine produced."""
    logits = reference_logits(reference, prompt, completion)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [processed_scores(logits[t], prompt, completion[:t], params) for t in range(len(completion))]
    processed = torch.log_softmax(torch.stack(rows), dim=-1)
    return raw, processed


def reference_generate(
    reference: torch.nn.Module, prompt: list[int], max_new_tokens: int, stops: tuple[int, ...] = (), **kwargs
) -> list[int]:
    """transformers' greedy `generate` (stops as eos ids; none means it never stops early)."""
    reference.generation_config.eos_token_id = None  # only the stops we pass may end generation
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(stops) or None, pad_token_id=0, **kwargs
    )
    output = reference.generate(torch.tensor([prompt]), generation_config=config)
    return output[0, len(prompt) :].tolist()


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= TOL  # a == b covers -inf == -inf


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], n: int = 1) -> dict:
    """Add (prompt, params) requests of n samples each, step to completion, check no KV block leaked."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params, n=n, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    engine.block_manager.check_all_free()
    return outputs


# ---- 1. log-probs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(LOGPROB_CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_processed_logprobs_match_transformers_processors(kind, case):
    """The "processed" log-prob of every sampled token equals log_softmax of transformers' processors applied to a
    teacher-forced forward of an untouched copy; the sampled token survived the filters; top_logprobs are the
    sorted top-k of that same distribution and agree with the sampled token's own log-prob."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    params = LOGPROB_CASES[case].merged(seed=11, top_logprobs=5)
    prompts = make_prompts(4, 4, 24, seed=1)
    outputs = run(make_engine(model), {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        out = outputs[str(i)]
        tokens = out.generated_tokens
        assert len(out.logprobs) == len(tokens) == len(out.top_logprobs) > 0
        _, processed = expected_logprobs(reference, prompt, tokens, params)
        for t, token in enumerate(tokens):
            where = f"prompt {i} position {t} token {token}"
            expected = processed[t, token].item()
            assert math.isfinite(expected), f"{where}: the sampled token was filtered out by the processors"
            assert math.isfinite(out.logprobs[t]), where
            assert abs(out.logprobs[t] - expected) <= TOL, (where, out.logprobs[t], expected)
            if params.greedy:
                assert token == processed[t].argmax().item(), where
            top = out.top_logprobs[t]
            ids, values = [tid for tid, _ in top], [v for _, v in top]
            assert len(top) == 5 and len(set(ids)) == 5, where
            assert values == sorted(values, reverse=True), where
            assert all(close(v, processed[t, tid].item()) for tid, v in top), where
            assert all(close(v, e) for v, e in zip(values, processed[t].topk(5).values.tolist())), where
            if token in ids:
                assert values[ids.index(token)] == out.logprobs[t], where


@pytest.mark.parametrize("kind", KINDS)
def test_raw_logprobs_are_log_softmax_of_unprocessed_logits(kind):
    """logprob_mode="raw" returns log_softmax of the model's own logits (ignoring penalties, masks and warpers),
    top_logprobs in the same mode, while sampling still obeys the filters."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    params = SamplingParams(
        temperature=0.6,
        top_k=8,
        top_p=0.9,
        repetition_penalty=1.4,
        presence_penalty=0.5,
        min_new_tokens=5,
        stop_token_ids=MANY_STOPS,
        seed=5,
        logprob_mode="raw",
        top_logprobs=3,
    )
    prompts = make_prompts(4, 4, 24, seed=2)
    outputs = run(make_engine(model), {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        out = outputs[str(i)]
        raw, processed = expected_logprobs(reference, prompt, out.generated_tokens, params)
        for t, token in enumerate(out.generated_tokens):
            assert math.isfinite(processed[t, token].item()), (i, t)
            assert abs(out.logprobs[t] - raw[t, token].item()) <= TOL, (i, t)
            expected_top = raw[t].topk(3)
            assert [tid for tid, _ in out.top_logprobs[t]] == expected_top.indices.tolist(), (i, t)
            assert all(close(v, e) for (_, v), e in zip(out.top_logprobs[t], expected_top.values.tolist())), (i, t)


@pytest.mark.parametrize("kind", KINDS)
def test_temperature_scaled_logprobs_are_what_a_trainer_recomputes(kind):
    """logprob_mode="temperature_scaled" returns log_softmax(logits / temperature) of a teacher-forced forward (what
    TRL's GRPOTrainer and verl's actors recompute), whatever penalties, masks and truncation shaped the sampling;
    temperature 0 counts as 1, a do_sample=False row keeps its temperature, and a "processed" row in the same batch
    keeps its own mode."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    scaled = dict(logprob_mode="temperature_scaled", top_logprobs=3)
    cases = {
        "truncated": SamplingParams(
            temperature=0.6,
            top_k=8,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.4,
            presence_penalty=0.5,
            min_new_tokens=5,
            stop_token_ids=MANY_STOPS,
            seed=5,
            **scaled,
        ),
        "greedy_temperature_0": SamplingParams(temperature=0, repetition_penalty=1.3, stop_token_ids=(), **scaled),
        "greedy_keeps_temperature": SamplingParams(do_sample=False, temperature=0.5, stop_token_ids=(), **scaled),
        "processed_beside": SamplingParams(temperature=0.6, top_k=8, seed=6, stop_token_ids=(), top_logprobs=3),
    }
    prompts = make_prompts(len(cases), 4, 24, seed=3)
    outputs = run(make_engine(model), {name: (p, cases[name]) for name, p in zip(cases, prompts)})
    for name, prompt in zip(cases, prompts):
        params, out = cases[name], outputs[name]
        logits = reference_logits(reference, prompt, out.generated_tokens)
        if params.logprob_mode == "processed":
            _, expected = expected_logprobs(reference, prompt, out.generated_tokens, params)
        else:
            expected = torch.log_softmax(logits / (params.temperature or 1.0), dim=-1)
        for t, token in enumerate(out.generated_tokens):
            assert abs(out.logprobs[t] - expected[t, token].item()) <= TOL, (name, t)
            top = expected[t].topk(3)
            assert [tid for tid, _ in out.top_logprobs[t]] == top.indices.tolist(), (name, t)
            assert all(close(v, e) for (_, v), e in zip(out.top_logprobs[t], top.values.tolist())), (name, t)
    truncated = outputs["truncated"]
    _, processed = expected_logprobs(reference, prompts[0], truncated.generated_tokens, cases["truncated"])
    # The sampled distribution differs (truncation renormalises), so the two modes really are different numbers.
    assert any(
        abs(lp - processed[t, tok].item()) > 1e-3
        for t, (tok, lp) in enumerate(zip(truncated.generated_tokens, truncated.logprobs))
    )


def test_mixed_batch_applies_each_requests_own_settings():
    """One batch mixing every LOGPROB_CASES setting and a penalized group of n=3 (whose samples share their
    leader's logits row for the first token): each sample's log-probs match transformers' processors with its own
    parameters and its own previous tokens (no setting or penalty state leaks across rows or samples)."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompts = make_prompts(len(LOGPROB_CASES) + 1, 4, 24, seed=3)
    requests = {case: (p, params.merged(seed=21)) for (case, params), p in zip(LOGPROB_CASES.items(), prompts)}
    engine = make_engine(model)
    for case, (prompt, params) in requests.items():
        engine.add_request(case, prompt, params, max_new_tokens=MAX_NEW)
    group = SamplingParams(temperature=0.9, top_k=30, repetition_penalty=1.4, frequency_penalty=-0.8, seed=5)
    outputs = run(engine, {"group": (prompts[-1], group)}, n=3)  # last in the batch: its row is not row 0
    requests.update({f"group#{i}": (prompts[-1], group) for i in range(3)})
    assert len({tuple(outputs[f"group#{i}"].generated_tokens) for i in range(3)}) == 3
    for case, (prompt, params) in requests.items():
        out = outputs[case]
        _, processed = expected_logprobs(reference, prompt, out.generated_tokens, params)
        expected = processed.gather(1, torch.tensor(out.generated_tokens).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=TOL, rtol=0), case


# ---- 2. greedy ----------------------------------------------------------------------------------------------------
GREEDY_CASES = {
    "temperature_zero": (SamplingParams(temperature=0, stop_token_ids=()), {}),
    "do_sample_false": (SamplingParams(do_sample=False, temperature=0.7, top_k=3, stop_token_ids=()), {}),
    "repetition": (
        SamplingParams(temperature=0, repetition_penalty=1.8, stop_token_ids=()),
        {"repetition_penalty": 1.8},
    ),
    "repetition_below_one": (
        SamplingParams(do_sample=False, repetition_penalty=0.6, stop_token_ids=()),
        {"repetition_penalty": 0.6},
    ),
    "stops_and_min_new": (
        SamplingParams(temperature=0, min_new_tokens=5, stop_token_ids=MANY_STOPS),
        {"min_new_tokens": 5},
    ),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_greedy_matches_generate(kind, case):
    """temperature=0 / do_sample=False give transformers' greedy `generate` token for token (with its repetition
    penalty, min_new_tokens and eos handling), and finish_reason says whether a stop token ended it."""
    params, generate_kwargs = GREEDY_CASES[case]
    model = tiny_model(kind)
    reference = reference_copy(model)
    prompts = make_prompts(4, 4, 24, seed=4)
    outputs = run(make_engine(model), {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        expected = reference_generate(reference, prompt, MAX_NEW, params.stop_token_ids, **generate_kwargs)
        out = outputs[str(i)]
        assert out.generated_tokens == expected, i
        stopped = expected[-1] in params.stop_token_ids
        assert out.finish_reason == ("stop" if stopped else "length"), i


# ---- 3. seeds -----------------------------------------------------------------------------------------------------
TARGETS = {
    "a": SamplingParams(temperature=1.0, seed=7, stop_token_ids=()),
    "b": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=8, stop_token_ids=()),
    "c": SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.5, seed=9, stop_token_ids=()),
}
COMPANIONS = {
    "x": SamplingParams(temperature=0.5, top_k=10, seed=100, stop_token_ids=()),
    "y": SamplingParams(temperature=0, stop_token_ids=()),
    "z": SamplingParams(temperature=1.5, presence_penalty=1.0, stop_token_ids=()),  # unseeded
}


@pytest.mark.parametrize("kind", KINDS)
def test_seed_reproduces_alone_in_mixed_batch_and_under_preemption(kind, unknown_lengths):
    """A seeded request samples the same tokens (and log-probs) run alone, inside a batch of different requests
    (other prompts, lengths, settings, a group), and in a tiny cache that forces chunked prefill and preemption
    (recompute, and swap to CPU)."""
    model = tiny_model(kind)
    prompts = make_prompts(6, 4, 30, seed=5)
    targets = {name: (prompt, params) for (name, params), prompt in zip(TARGETS.items(), prompts)}
    companions = {name: (prompt, params) for (name, params), prompt in zip(COMPANIONS.items(), prompts[3:])}
    alone = {}
    for name, request in targets.items():
        alone.update(run(make_engine(model), {name: request}))
    mixed_engine = make_engine(model)
    group = SamplingParams(seed=7, stop_token_ids=())
    mixed_engine.add_request("group", prompts[0], group, n=3, max_new_tokens=MAX_NEW)
    mixed = run(mixed_engine, {**companions, **targets})
    runs = {"mixed": mixed}
    for mode, offload in (("recompute", 0.0), ("swap", 0.01)):
        tight = make_engine(model, num_blocks=14, max_batch_tokens=16, cpu_offload_space=offload)
        tight.add_request("group", prompts[1], SamplingParams(seed=3, stop_token_ids=()), n=2, max_new_tokens=MAX_NEW)
        runs[mode] = run(tight, {**companions, **targets})
        assert tight.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
        assert (tight.scheduler.num_swaps > 0) == (mode == "swap")
    for mode, outputs in runs.items():
        for name in targets:
            assert outputs[name].generated_tokens == alone[name].generated_tokens, (mode, name)
            got, expected = torch.tensor(outputs[name].logprobs), torch.tensor(alone[name].logprobs)
            assert torch.allclose(got, expected, atol=TOL, rtol=0), (mode, name)


def test_different_seeds_give_different_completions():
    """Same prompt and settings, seeds 0..3 and the pairs Python's hash confuses (-1 and -2; 0 and 2**61 - 1, which
    integer hashing wraps to 0): pairwise different completions."""
    model = tiny_model("qwen3")
    prompt = make_prompts(1, 10, 10, seed=6)[0]
    seeds = [0, 1, 2, 3, -1, -2, 2**61 - 1, 5 + 2**61 - 1, 5]
    outputs = run(make_engine(model), {str(s): (prompt, SamplingParams(seed=s, stop_token_ids=())) for s in seeds})
    completions = {tuple(out.generated_tokens) for out in outputs.values()}
    assert len(completions) == len(seeds)


@pytest.mark.parametrize("kind", KINDS)
def test_group_samples_differ_and_are_reproducible(kind):
    """A group of n=4 with seed s: its samples differ from each other; the same group in a fresh engine and in a
    different batch (other groups, a tight cache) gives the same four samples; sample 0 equals a lone (n=1)
    request with seed s, since sample i uses (seed, i) and a lone request is sample 0."""
    model = tiny_model(kind)
    prompt, other = make_prompts(2, 12, 20, seed=7)
    params = SamplingParams(temperature=1.0, top_k=50, seed=42, stop_token_ids=())
    ids = [f"g#{i}" for i in range(4)]

    first = run(make_engine(model), {"g": (prompt, params)}, n=4)
    samples = [tuple(first[i].generated_tokens) for i in ids]
    assert len(set(samples)) == 4, "the samples of a group must differ"
    assert [first[i].sample_index for i in ids] == [0, 1, 2, 3]

    again = run(make_engine(model), {"g": (prompt, params)}, n=4)
    assert [tuple(again[i].generated_tokens) for i in ids] == samples

    busy = make_engine(model, num_blocks=20, max_batch_tokens=16)
    other_params = SamplingParams(temperature=0.7, seed=1, stop_token_ids=())
    busy.add_request("h", other, other_params, n=4, max_new_tokens=MAX_NEW)
    busy.add_request("lone", prompt, params, max_new_tokens=MAX_NEW)
    elsewhere = run(busy, {"g": (prompt, params)}, n=4)
    assert busy.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    assert [tuple(elsewhere[i].generated_tokens) for i in ids] == samples
    assert tuple(elsewhere["lone"].generated_tokens) == samples[0]


def test_sampling_leaves_global_rng_untouched():
    """Seeded and unseeded sampling (groups included) never read or advance torch's global RNG, and a seeded
    completion does not depend on the global RNG's state."""
    model = tiny_model("qwen3")
    prompts = make_prompts(3, 5, 20, seed=8)
    requests = {
        "seeded": (prompts[0], SamplingParams(temperature=0.9, top_p=0.95, seed=3, stop_token_ids=())),
        "unseeded": (prompts[1], SamplingParams(temperature=1.1, top_k=20, stop_token_ids=())),
        "group": (prompts[2], SamplingParams(min_p=0.1, seed=4, stop_token_ids=())),
    }
    tokens = []
    for global_seed in (0, 99):
        torch.manual_seed(global_seed)
        engine = make_engine(model)
        before = torch.get_rng_state()
        for request_id, (prompt, params) in requests.items():
            engine.add_request(request_id, prompt, params, n=3 if request_id == "group" else 1, max_new_tokens=MAX_NEW)
        outputs = run_to_completion(engine)
        assert torch.equal(torch.get_rng_state(), before), "sampling touched the global torch RNG"
        engine.block_manager.check_all_free()
        tokens.append({k: v.generated_tokens for k, v in outputs.items() if k != "unseeded"})
    assert tokens[0] == tokens[1]


# ---- 4. stop tokens -----------------------------------------------------------------------------------------------
def test_stop_tokens_end_with_stop_else_length():
    """Several stop ids: a completion that meets one ends right there with finish_reason "stop" (stop token
    included as its last token); one that never meets one runs to max_new_tokens with "length"."""
    model = tiny_model("qwen3")
    stops = tuple(range(3, VOCAB, 16))  # 16 stop ids
    prompts = make_prompts(8, 4, 20, seed=9)
    params = SamplingParams(temperature=1.0, stop_token_ids=stops, seed=13)
    outputs = run(make_engine(model), {str(i): (p, params) for i, p in enumerate(prompts)})
    reasons = set()
    for out in outputs.values():
        tokens = out.generated_tokens
        assert not set(tokens[:-1]) & set(stops), "generation went on past a stop token"
        if out.finish_reason == "stop":
            assert tokens[-1] in stops and len(tokens) <= MAX_NEW
        else:
            assert out.finish_reason == "length" and len(tokens) == MAX_NEW and tokens[-1] not in stops
        reasons.add(out.finish_reason)
    assert reasons == {"stop", "length"}, "the setup should produce both endings"


def test_stop_token_ends_greedy_completion_exactly_where_it_appears():
    """Greedy: taking as stop ids a token the unconstrained completion produces first at position j (and one at the
    very last position) cuts the completion to its first j + 1 tokens with "stop"; a stop at the last allowed
    position still reports "stop", not "length"."""
    model = tiny_model("llama")
    engine = make_engine(model)
    greedy = SamplingParams(temperature=0, stop_token_ids=())
    prompts = make_prompts(6, 4, 20, seed=10)
    free = run(engine, {str(i): (p, greedy) for i, p in enumerate(prompts)})
    checked_last = 0
    for i, prompt in enumerate(prompts):
        tokens = free[str(i)].generated_tokens
        for j in (2, MAX_NEW - 1):
            if tokens[j] in tokens[:j]:
                continue
            unused = next(t for t in range(VOCAB) if t not in tokens)
            out = run(engine, {"s": (prompt, greedy.merged(stop_token_ids=(unused, tokens[j])))})["s"]
            assert out.generated_tokens == tokens[: j + 1], (i, j)
            assert out.finish_reason == "stop", (i, j)
            checked_last += j == MAX_NEW - 1
    assert checked_last, "no prompt exercised a stop at the last position"


def test_min_new_tokens_masks_stop_tokens():
    """With min_new_tokens=m no stop token appears among the first m tokens (they get probability 0), and the
    first stop after that ends the completion; without the mask the same seeds stop earlier."""
    model = tiny_model("qwen3")
    prompts = make_prompts(6, 4, 20, seed=11)
    base = SamplingParams(temperature=1.0, stop_token_ids=MANY_STOPS, seed=17, top_logprobs=3)
    masked = run(make_engine(model), {str(i): (p, base.merged(min_new_tokens=6)) for i, p in enumerate(prompts)})
    unmasked = run(make_engine(model), {str(i): (p, base) for i, p in enumerate(prompts)})
    for out in masked.values():
        tokens = out.generated_tokens
        assert len(tokens) >= 6 and not set(tokens[:6]) & set(MANY_STOPS), tokens
        assert not set(tokens[6:-1]) & set(MANY_STOPS), tokens
        assert out.finish_reason == ("stop" if tokens[-1] in MANY_STOPS else "length")
        for top in out.top_logprobs[:6]:  # masked stops never rank among the most likely tokens
            assert not {tid for tid, _ in top} & set(MANY_STOPS), top
    assert any(out.finish_reason == "stop" for out in masked.values())
    assert any(len(out.generated_tokens) < 6 for out in unmasked.values()), "the setup should stop early unmasked"


def test_top_entries_rank_equal_scores_by_token_id_whatever_the_width():
    """The top log-probs' ranking is a stable descending sort's (equal scores in token id order) at every width, over
    bf16-rounded log-probs full of ties and -inf entries (torch.topk orders ties differently for another width)."""
    from rollout.engine.sampling.sampled_logprobs import top_entries

    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(64, 300, generator=generator) * 2).bfloat16().float().log_softmax(-1)
    scores[torch.rand(scores.shape, generator=generator) < 0.5] = float("-inf")
    scores[:4, 10:] = float("-inf")  # rows with fewer finite entries than the widths asked
    expected_values, expected_columns = scores.sort(dim=-1, descending=True, stable=True)
    for width in (1, 3, 10, 17, 300):
        values, columns = top_entries(scores, width)
        assert torch.equal(columns, expected_columns[:, :width]), width
        assert torch.equal(values, expected_values[:, :width]), width
    values, columns = top_entries(scores.bfloat16(), 17)
    assert torch.equal(columns, scores.bfloat16().sort(dim=-1, descending=True, stable=True).indices[:, :17])


def alone_and_beside(narrow: SamplingParams, other: SamplingParams, seed: int, **config) -> tuple:
    """The output of a request sampled with `narrow`, alone, then beside one sampled with `other`."""
    prompts = make_prompts(2, 4, 10, seed=seed)

    def narrow_output(beside: bool):
        engine = make_engine(tiny_model("qwen3"), **config)
        engine.add_request("narrow", prompts[0], narrow, max_new_tokens=5)
        if beside:
            engine.add_request("other", prompts[1], other, max_new_tokens=5)
        output = run_to_completion(engine)["narrow"]
        engine.close()
        return output

    return narrow_output(False), narrow_output(True)


def test_a_requests_top_logprobs_do_not_depend_on_the_widest_request_beside_it():
    """A request with top_k=2 asking for 4 top log-probs (processed mode: two finite entries, then -inf ones): the
    -inf entries are the lowest other token ids, and all four are the same, bit for bit, alone as beside a request
    asking for 20 (they were not: ties were ordered by the widest request's topk)."""
    narrow = SamplingParams(temperature=1.0, top_k=2, top_logprobs=4, seed=1, stop_token_ids=())
    wide = SamplingParams(temperature=1.0, top_logprobs=20, seed=2, stop_token_ids=())
    alone, beside = alone_and_beside(narrow, wide, 5, batch_invariant=True)
    assert alone.generated_tokens == beside.generated_tokens
    assert alone.top_logprobs == beside.top_logprobs
    for top in alone.top_logprobs:
        finite = [token for token, value in top if value > float("-inf")]
        assert len(finite) == 2
        assert [token for token, value in top if value == float("-inf")] == [t for t in range(4) if t not in finite][:2]


def test_a_top_k_rows_top_logprobs_are_the_same_from_candidates_as_from_whole_rows():
    """A top_k=3 sample asking for 6 top log-probs: alone its step draws from top_k candidates, beside a sample
    without top_k from whole rows. Its three -inf entries name the same tokens either way (the lowest ids outside its
    finite ones: they named its lowest removed candidates), its finite ones the same tokens up to rounding."""
    narrow = SamplingParams(temperature=1.0, top_k=3, seed=1, top_logprobs=6, stop_token_ids=())
    whole = SamplingParams(temperature=1.0, seed=2, stop_token_ids=())
    candidates, rows = alone_and_beside(narrow, whole, 1)
    assert candidates.generated_tokens == rows.generated_tokens
    for from_candidates, from_rows in zip(candidates.top_logprobs, rows.top_logprobs):
        assert [token for token, _ in from_candidates] == [token for token, _ in from_rows]
        assert [value for _, value in from_candidates][3:] == [float("-inf")] * 3
        assert all(close(a, b) for (_, a), (_, b) in zip(from_candidates, from_rows))


def test_top_logprobs_over_a_small_vocabulary_are_refused_by_name_and_the_whole_vocabulary_is_served():
    """A model of 32 tokens: top_logprobs=40 (in process up to 100) failed its sample mid-step with torch's "selected
    index k out of range"; it is refused at intake naming top_logprobs. top_logprobs=32 ranks the whole vocabulary:
    log_softmax of a teacher-forced forward of an untouched copy."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rollout import generate_batch

    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=32, num_key_value_heads=1, **small)).eval()
    reference = reference_copy(model)
    prompt = [1, 2, 3]
    with pytest.raises(FieldError, match="exceeds the vocabulary size 32") as refused:
        generate_batch(model, [prompt], sampling=SamplingParams(top_logprobs=40, seed=1), progress_bar=False)
    assert refused.value.field == "top_logprobs"
    params = SamplingParams(top_logprobs=32, seed=1, stop_token_ids=())
    (out,) = generate_batch(model, [prompt], sampling=params, max_new_tokens=3, progress_bar=False).values()
    expected = torch.log_softmax(reference_logits(reference, prompt, out.generated_tokens), dim=-1)
    for t, top in enumerate(out.top_logprobs):
        assert sorted(token for token, _ in top) == list(range(32))
        assert all(close(value, expected[t, token].item()) for token, value in top)


# ---- counter-based randomness -------------------------------------------------------------------------------------
def test_uniforms_are_splitmix64_streams():
    """A row's uniform number is the position-th output of a SplitMix64 stream started at its sample's stream id:
    the published outputs of the reference generator (Vigna's splitmix64.c) seeded with 0, and those of Rosetta Code's
    "Pseudo-random numbers/Splitmix64" task, seeded with 1234567."""
    from rollout.engine.sampling.draw import splitmix64, uniforms

    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    assert splitmix64(np.zeros(4, dtype=np.uint64), np.arange(1, 5)).tolist() == published
    seeded = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]
    assert splitmix64(np.full(5, 1234567, dtype=np.uint64), np.arange(1, 6)).tolist() == seeded
    assert uniforms(np.zeros(1, dtype=np.uint64), np.ones(1)).tolist() == [((published[0] >> 12) + 0.5) * 2.0**-52]


def test_uniforms_are_uniform_deterministic_and_decorrelated():
    """The sampler's counter-based uniforms: a pure function of (stream id, position), uniform on (0, 1) (moments
    and Kolmogorov-Smirnov distance), and consecutive positions, and streams of consecutive ids, uncorrelated."""
    from rollout.engine.sampling.draw import uniforms

    positions = np.arange(200_000)
    for bases in (np.full(200_000, (1 << 40) + 7919, dtype=np.uint64), np.arange(200_000, dtype=np.uint64)):
        u = torch.from_numpy(uniforms(bases, positions))
        assert torch.equal(u, torch.from_numpy(uniforms(bases, positions)))
        assert u.min().item() > 0 and u.max().item() < 1
        assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
        ordered = u.sort().values
        ks = (ordered - torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)).abs().max().item()
        assert ks < 1.63 / math.sqrt(len(u))  # Kolmogorov-Smirnov at p = 0.01
        centred = u - 0.5
        assert abs((centred[:-1] * centred[1:]).mean().item()) < 0.001


def test_inverse_cdf_samples_the_distribution_and_never_zero_probability():
    """sample_from draws column i with probability p_i (chi-square over 20000 draws) and never a zero column."""
    from rollout.engine.sampling.draw import sample_from, uniforms

    probs = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.15, 0.1, 0.05, 0.0])
    draws = 20_000
    picks = sample_from(probs.expand(draws, -1), torch.from_numpy(uniforms(np.full(draws, 12345), np.arange(draws))))
    observed = torch.bincount(picks, minlength=len(probs)).double()
    assert observed[probs == 0].sum().item() == 0
    nonzero = probs > 0
    expected = probs[nonzero].double() * draws
    chi_square = ((observed[nonzero] - expected) ** 2 / expected).sum().item()
    assert chi_square < 18.5  # 4 degrees of freedom: p = 0.001


def test_fp32_logits_computes_the_projection_in_fp32():
    """A bf16 model: by default the logprobs match transformers' bf16 lm_head on a teacher-forced forward; with
    fp32_logits=True they match an fp32 projection of the same hidden states instead (and the bf16 weights are
    left as they are)."""
    from rollout import Engine
    from rollout.presets import tiny_model as preset_model

    model = preset_model(0, dtype=torch.bfloat16)
    prompt = make_prompts(1, 40, 40, seed=9)[0]
    params = SamplingParams(do_sample=False, max_new_tokens=16, stop_token_ids=())
    results = {}
    for flag in (False, True):
        engine = Engine(copy.deepcopy(model), ContinuousBatchingConfig(num_blocks=64, fp32_logits=flag))
        engine.add_request("a", prompt, params)
        results[flag] = run_to_completion(engine)["a"]
        engine.close()
    tokens = results[False].generated_tokens
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
        bf16_head = torch.log_softmax(model.lm_head(hidden).float(), -1)
        fp32_head = torch.log_softmax(hidden.float() @ model.lm_head.weight.float().T, -1)
    index = torch.tensor(tokens).unsqueeze(1)
    bf16_ref, fp32_ref = bf16_head.gather(1, index)[:, 0], fp32_head.gather(1, index)[:, 0]
    default, fp32 = torch.tensor(results[False].logprobs), torch.tensor(results[True].logprobs)
    assert (default - bf16_ref).abs().mean() < 2e-3  # bf16 logits: one rounding step is ~4e-3 here
    assert (fp32 - fp32_ref).abs().mean() < 0.5 * (fp32 - bf16_ref).abs().mean()
    assert (fp32 - fp32_ref).abs().mean() < 2e-3
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_sampling_slots_grow_are_given_back_and_reused():
    """More samples than the slot tables first hold run at once (the tables grow, and every sample still draws with
    its own seed: 80 different completions); each slot comes back when its sample finishes; then a slot that held
    a top-k/top-p sample's settings serves a greedy request exactly as transformers' greedy `generate`."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    engine = make_engine(model, num_blocks=1024)
    slots = engine.sampler.slots
    first_capacity = slots.num_live + len(slots._free)  # noqa: SLF001 - the tables' size
    prompt = make_prompts(1, 8, 8, seed=9)[0]
    wide = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1, stop_token_ids=())
    outputs = run(engine, {"wide": (prompt, wide)}, n=first_capacity + 16)
    assert len({tuple(out.generated_tokens) for out in outputs.values()}) == first_capacity + 16
    assert slots.num_live == 0 and not any(slots.uses.values())
    out = run(engine, {"greedy": (prompt, SamplingParams(temperature=0, stop_token_ids=()))})["greedy"]
    assert out.generated_tokens == reference_generate(reference, prompt, MAX_NEW)
    assert slots.num_live == 0


def test_a_step_that_fails_while_writing_slot_rows_leaves_nothing_for_the_slots_next_owner(monkeypatch):
    """The table write of a new sample's row fails (as a CUDA OOM would): its group ends with an error, its slot
    comes back with no row left pending for it, and the next request on that slot samples with its own settings
    (greedy, as transformers' `generate`)."""
    import rollout.engine.sampling.slots as sampling_slots

    model = tiny_model("qwen3")
    reference = reference_copy(model)
    engine = make_engine(model)
    real_to_device = sampling_slots.to_device
    failures = [RuntimeError("simulated out of memory while staging slot rows")]

    def flaky_to_device(values, dtype, device):
        if failures and dtype is torch.float32:
            raise failures.pop()
        return real_to_device(values, dtype, device)

    monkeypatch.setattr(sampling_slots, "to_device", flaky_to_device)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.7, top_k=5, seed=1), max_new_tokens=4)
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and "simulated out of memory" in failed.error
    slots = engine.sampler.slots
    assert slots.num_live == 0 and slots._pending == []  # noqa: SLF001 - nothing left to land on the freed slot
    prompt = make_prompts(1, 8, 8, seed=12)[0]
    out = run(engine, {"b": (prompt, SamplingParams(do_sample=False, stop_token_ids=()))})["b"]
    assert out.generated_tokens == reference_generate(reference, prompt, MAX_NEW)


def test_a_sampling_map_asking_greedy_picks_and_a_shaped_distribution_is_refused_by_name():
    """The wire's sampling map with do_sample False and, in the same map, a field a greedy pick ignores: refused
    naming the field (it was silently greedy); neutral values and do_sample True pass."""
    for field, value in (("temperature", 5.0), ("top_k", 3), ("typical_p", 0.2), ("eta_cutoff", 0.3)):
        with pytest.raises(FieldError, match=f"sampling.{field}: has no effect while do_sample is False"):
            SamplingParams.from_fields({"do_sample": False, field: value})
    assert not SamplingParams.from_fields({"do_sample": False, "temperature": 0.0, "top_p": 1.0}).do_sample
    assert SamplingParams.from_fields({"do_sample": True, "temperature": 5.0}).temperature == 5.0
    # The temperature scales temperature_scaled log-probs, greedy or not (a do_sample=False row keeps it): accepted.
    scaled = {"do_sample": False, "temperature": 0.5, "logprob_mode": "temperature_scaled"}
    assert SamplingParams.from_fields(scaled).temperature == 0.5
    with pytest.raises(FieldError, match="sampling.top_k: has no effect while do_sample is False"):
        SamplingParams.from_fields({**scaled, "top_k": 3})

"""A seeded differential fuzzer of speculative decoding: each case draws a workload (sampling settings, engine
settings, when groups arrive, a cancel or a weight update), runs it on a plain engine and on a `speculative="suffix"`
one, and compares every sample's tokens, log-probs, top log-probs, prompt log-probs, finish reason and policy
versions (streamed samples: their deltas put together). The reference is the plain engine: bit for bit under
`batch_invariant=True`; without it, the same tokens and log-probs within 1e-4 (fp32).

The settings are drawn around each prompt's greedy continuation, which the draft pools hold: stop tokens, stop
strings, bad words, suppressed tokens and logit_bias fall on tokens the drafts propose, so they land inside accepted
runs; each group runs twice (the second time with the same seed, or the next), so the first run's samples are
(near) exact drafts for the second's. The fixed case seeds are chosen so that, together, samples end inside accepted
runs by a stop token, a stop string and max_new_tokens, and samples are preempted, cancelled and updated while
drafted."""

from __future__ import annotations

import copy
import functools
import random
from collections import Counter

import pytest
from test_speculative import EOS, MODEL, TOKENIZER, every_draft  # noqa: F401 - every_draft is a fixture

from conftest import make_prompts, run_to_completion
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

A, B = TOKENIZER.convert_tokens_to_ids(["a", "b"])
INVARIANT_CASES = [2, 4, 6, 16, 22, 25, 32, 33, 36, 37]
FP32_CASES = [24, 26]


@functools.cache
def greedy_continuation(prompt: tuple[int, ...]) -> list[int]:
    """The prompt's greedy continuation of 24 tokens on a plain engine (what the draft pools start from)."""
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=64, block_size=4, batch_invariant=True))
    engine.add_request("ref", list(prompt), SamplingParams(temperature=0.0, stop_token_ids=[]), max_new_tokens=24)
    tokens = list(run_to_completion(engine)["ref"].generated_tokens)
    engine.close()
    return tokens


def random_sampling(rng: random.Random, ref: list[int], max_new: int, logprobs: bool) -> dict:
    """Sampling settings aimed at the tokens the drafts (the greedy continuation `ref`) propose."""
    pick = lambda low=2, high=20: ref[rng.randrange(low, high)]  # noqa: E731
    s: dict = dict(temperature=rng.choice([0.0, 0.5, 1.0]), seed=rng.randrange(100))
    s["stop_token_ids"] = rng.choice([[], [EOS], [pick(4)]])
    for field, chance, value in [
        ("repetition_penalty", 0.3, 1.3),
        ("presence_penalty", 0.2, 0.3),
        ("frequency_penalty", 0.2, 0.2),
        ("no_repeat_ngram_size", 0.2, rng.choice([2, 3])),
        ("suppress_tokens", 0.2, [pick(3)]),
        ("begin_suppress_tokens", 0.2, [ref[0]]),
        ("min_new_tokens", 0.4, rng.randrange(1, max_new + 1)),
        ("logit_bias", 0.4, {pick(): rng.choice([-3.0, 2.0, -100.0])}),
    ]:
        if rng.random() < chance:
            s[field] = value
    if rng.random() < 0.3:
        start = rng.randrange(2, 18)
        s["bad_words_ids"] = [ref[start : start + rng.choice([1, 2, 3])]]
    if rng.random() < 0.4:
        start = rng.randrange(2, 18)
        s["stop"] = [TOKENIZER.decode(ref[start : start + rng.choice([1, 2, 3])])]
        s["include_stop_str_in_output"] = rng.random() < 0.5
    if s["temperature"]:
        for field, values in [("top_k", [2, 5, 50]), ("top_p", [0.5, 0.9]), ("min_p", [0.05, 0.2])]:
            if rng.random() < 0.3:
                s[field] = rng.choice(values)
    if logprobs and rng.random() < 0.3:
        s["top_logprobs"] = rng.choice([1, 3])
    if logprobs and rng.random() < 0.2:
        s["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.1:  # a grammar the tiny model follows, pushed towards it
        s.update(regex=r"(ab|abc|c| )+", logit_bias={A: 5.0, B: 5.0})
    s["logprob_mode"] = rng.choice(["processed", "raw", "temperature_scaled"])
    return s


def draw_case(seed: int, invariant: bool) -> tuple[list[list[int]], dict, list, list]:
    """(prompts, engine settings, group arrivals (step, id, prompt index, sampling, n, max_new_tokens, streaming),
    events (step, kind, argument))."""
    rng = random.Random(seed)
    prompts = make_prompts(rng.randint(1, 2), 5, 16, seed=seed)
    block_size = rng.choice([4, 8])
    config = dict(block_size=block_size, num_blocks=rng.choice([128, 14, 12]) * 4 // block_size)
    config.update(
        batch_invariant=invariant, overlap_scheduling=rng.random() < 0.5, speculative_disable_by_batch_size=64
    )
    config["num_speculative_tokens"] = rng.choice([2, 4, 7, 12])
    for field, chance, value in [
        ("max_batch_tokens", 0.4, rng.choice([12, 16])),
        ("return_logprobs", 0.2, False),
        ("cpu_offload_space", 0.3, 0.01),
        ("scheduler_type", 0.2, "prefill_first"),
        ("max_num_seqs", 0.2, 3),
    ]:
        if rng.random() < chance:
            config[field] = value
    arrivals = []
    for group in range(rng.randint(1, 3)):
        index, max_new = rng.randrange(len(prompts)), rng.choice([5, 11, 24])
        sampling = random_sampling(rng, greedy_continuation(tuple(prompts[index])), max_new,
                                   config.get("return_logprobs", True))  # fmt: skip
        n, step = rng.choice([1, 2, 3]), rng.choice([0, 0, 5, 12])
        arrivals.append((step, f"first{group}", index, sampling, n, max_new, False))
        again = dict(sampling, seed=sampling["seed"] + (rng.random() < 0.3))
        arrivals.append((step + 30, f"again{group}", index, again, n, max_new, rng.random() < 0.3))
    events = []
    if rng.random() < 0.3:
        events.append((rng.randrange(32, 45), "cancel", rng.choice(arrivals)[1]))
    if rng.random() < 0.3:
        events.append((rng.randrange(32, 45), "update", rng.choice(["keep", "recompute", "abort"])))
    return prompts, config, sorted(arrivals, key=lambda arrival: arrival[0]), events


def run(speculative: str | None, prompts: list, config: dict, arrivals: list, events: list) -> tuple[dict, Counter]:
    """Each sample's (tokens, log-probs, (finish reason, error), per-token versions, top log-probs, prompt
    log-probs), and what the drafted steps did (accepted drafts, samples ended inside an accepted run, by reason)."""
    settings = dict(config) if speculative else {k: v for k, v in config.items() if "speculative" not in k}
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(**settings, speculative=speculative),
                    tokenizer=TOKENIZER)  # fmt: skip
    seen: Counter = Counter()
    if speculative:
        verified = engine.scheduler.drafter.verified

        def counted(request, proposed: int, accepted: int) -> None:
            seen["accepted"] += accepted
            if accepted and request.is_finished:
                stop_string = request.stop_text is not None and request.stop_text.stopped is not None
                seen["ended in a run: " + ("stop string" if stop_string else request.finish_reason)] += 1
            verified(request, proposed, accepted)

        engine.scheduler.drafter.verified = counted
    for index, prompt in enumerate(prompts):  # the pools start with the greedy continuations
        engine.add_request(
            f"pool{index}", prompt, SamplingParams(temperature=0.0, stop_token_ids=[]), max_new_tokens=24
        )
    parts: dict[str, list] = {}

    def collect(outputs) -> None:
        for out in outputs:
            tokens, logprobs, _, versions, top, _ = parts.setdefault(out.request_id, [[], [], None, [], [], None])
            offset = len(tokens)
            tokens += out.generated_tokens
            logprobs += out.logprobs
            top += [list(map(tuple, entry)) for entry in out.top_logprobs]
            for index, (version, start) in enumerate(out.policy_versions):
                end_at = out.policy_versions[index + 1][1] if index + 1 < len(out.policy_versions) else None
                versions += [version] * len(out.generated_tokens[start:end_at])
            if out.prompt_logprobs is not None:
                parts[out.request_id][5] = (out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_logprob_ranks)
            if out.is_finished:
                parts[out.request_id][2] = (out.finish_reason, out.error)
            assert offset + len(out.generated_tokens) == len(tokens)

    pending, step = list(arrivals), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, group, index, sampling, n, max_new, streaming = pending.pop(0)
            engine.add_request(group, prompts[index], SamplingParams(**sampling), n=n, max_new_tokens=max_new,
                               streaming=streaming)  # fmt: skip
        for at, kind, argument in events:
            if at == step and kind == "cancel":
                collect(engine.cancel(argument))
            elif at == step:
                weight = engine.model.get_output_embeddings().weight
                collect(engine.update_weights({"lm_head.weight": weight * 1.05}, mode=argument, partial=True).outputs)
        collect(engine.step())
        step += 1
    seen["preemptions"] = engine.scheduler.num_preemptions
    engine.close()
    return {key: tuple(value) for key, value in parts.items()}, seen


def assert_same(plain: dict, drafted: dict, events: list, invariant: bool) -> None:
    """Equal samples; where a weight update or an abort makes the two runs' samples differ in what they saw, the
    tokens both sampled under the same weights (the old ones only, after a "keep" update: its KV mixes them)."""
    assert drafted.keys() == plain.keys()
    modes = [argument for _, kind, argument in events if kind == "update"]
    tolerance = 0.0 if invariant else 1e-4
    for key, expected in plain.items():
        got = drafted[key]
        count = len(expected[0])
        aborted = "abort" in (expected[2][0], got[2][0])
        if modes or aborted:  # the longest prefix both sampled under the same weights
            count = 0
            while count < min(len(expected[3]), len(got[3])) and expected[3][count] == got[3][count]:
                if "keep" in modes and expected[3][count] > 0:
                    break
                count += 1
        else:
            assert (got[2], got[3]) == (expected[2], expected[3]), key
            assert got[4:] == expected[4:] if invariant else len(got[4]) == len(expected[4]), key
        assert got[0][:count] == expected[0][:count], key
        assert len(got[1][:count]) == len(expected[1][:count]), key
        assert all(abs(a - b) <= tolerance for a, b in zip(got[1][:count], expected[1])), key


def fuzz(seeds: list[int], invariant: bool) -> Counter:
    """Run each case on both engines and compare them; returns what the cases covered (summed `run` counts, events).

    Args:
        seeds: the cases (`draw_case` seeds).
        invariant: `batch_invariant` (bit for bit) or not (log-probs within 1e-4).
    """
    seen: Counter = Counter()
    for seed in seeds:
        prompts, config, arrivals, events = draw_case(seed, invariant)
        plain, _ = run(None, prompts, config, arrivals, events)
        drafted, counts = run("suffix", prompts, config, arrivals, events)
        assert counts["accepted"] > 0, f"case {seed}: drafts should be accepted, or nothing was compared"
        assert_same(plain, drafted, events, invariant)
        seen += counts
        seen.update(kind for _, kind, _ in events)
    return seen


@pytest.mark.usefixtures("every_draft")
def test_drafted_samples_equal_plain_ones_bit_for_bit_under_batch_invariance():
    seen = fuzz(INVARIANT_CASES, invariant=True)
    for what in ("ended in a run: stop", "ended in a run: stop string", "ended in a run: length", "preemptions",
                 "cancel", "update"):  # fmt: skip
        assert seen[what] > 0, f"the cases should cover {what!r}: {seen}"


@pytest.mark.usefixtures("every_draft")
def test_drafted_samples_equal_plain_ones_in_fp32():
    fuzz(FP32_CASES, invariant=False)

"""A hostile client against a real worker: sampling values that pass every field's own check but would poison the
engine step they share with other clients' samples, or turn the sender's own log-probs into NaN, are refused by name
before they reach the engine, and the other clients' samples run on."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from rollout import protocol as p
from rollout.config import FieldError, SamplingParams
from rollout.sampling_params import MIN_REPETITION_PENALTY
from service_helpers import Client

pytestmark = pytest.mark.timeout(60)

VICTIM_TOKENS = 48


@pytest.fixture
def worker(http_worker):
    return http_worker  # the session's worker on the tiny model (nothing here changes its state)


def _running_victim(worker) -> Client:
    """Another client's greedy group, streaming: once its first delta came, its samples are in the engine's steps."""
    victim = Client(worker.address)
    sampling = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": VICTIM_TOKENS}
    victim.send(p.Generate("victim", [5, 6, 7, 8], n=2, sampling=sampling, stream=True))
    assert isinstance(victim.receive(), p.Delta)
    return victim


@pytest.mark.parametrize("min_new_tokens", [2**63, 2**64 - 1, 257])
def test_min_new_tokens_past_the_default_length_is_refused_and_poisons_no_other_client(worker, min_new_tokens):
    """Without max_new_tokens, min_new_tokens was checked against nothing: one past int64 reached the sampler's
    int64 table and failed the whole engine step, ending another client's running samples with "error"."""
    victim = _running_victim(worker)
    attacker = Client(worker.address)
    try:
        attacker.send(p.Generate("attack", [1, 2, 3], sampling={"min_new_tokens": min_new_tokens}))
        refusal = attacker.receive()
        assert isinstance(refusal, p.Error) and refusal.code == "bad_request", refusal
        assert refusal.field == "sampling.min_new_tokens" and refusal.group_id == "attack"
        assert "256" in refusal.message  # the length it was compared with: the worker's default max_new_tokens
        _, result = victim.until_result("victim")
        assert [c.finish_reason for c in result.completions] == ["length", "length"], result
        assert all(len(c.token_ids) == VICTIM_TOKENS and c.error is None for c in result.completions)
    finally:
        attacker.close()
        victim.close()


def test_min_new_tokens_above_the_default_length_is_served_with_max_new_tokens_given(worker):
    client = Client(worker.address)
    try:
        sampling = {"min_new_tokens": 260, "max_new_tokens": 270, "stop_token_ids": list(range(64))}
        client.send(p.Generate("ok", [1, 2], sampling=sampling))
        _, result = client.until_result("ok")
        completion = result.completions[0]
        assert completion.finish_reason in ("stop", "length") and 260 <= len(completion.token_ids) <= 270
        assert not set(completion.token_ids[:259]) & set(range(64))  # the stops stay masked until min_new_tokens
    finally:
        client.close()


def test_a_repetition_penalty_that_overflows_fp32_is_refused_by_name(worker):
    """transformers' own processor shows why: in fp32 a penalty of 1e-39 turns seen tokens' scores into inf (and
    NaN beside them), where the floor keeps them finite; the worker served such a request and answered the last token
    id with -inf and NaN log-probs."""
    scores = torch.linspace(-30.0, 30.0, 64).unsqueeze(0)
    seen = torch.arange(0, 64, 2).unsqueeze(0)
    assert not torch.isfinite(RepetitionPenaltyLogitsProcessor(1e-39)(seen, scores.clone())).all()
    assert torch.isfinite(RepetitionPenaltyLogitsProcessor(MIN_REPETITION_PENALTY)(seen, scores.clone())).all()
    with pytest.raises(FieldError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-39)

    client = Client(worker.address)
    try:
        client.send(p.Generate("tiny-penalty", [1, 2, 3], sampling={"repetition_penalty": 5e-324}))
        refusal = client.receive()
        assert isinstance(refusal, p.Error) and refusal.field == "sampling.repetition_penalty", refusal
        sampling = {"repetition_penalty": MIN_REPETITION_PENALTY, "max_new_tokens": 6, "stop_token_ids": []}
        client.send(p.Generate("floor", list(range(1, 64)), sampling=sampling))
        _, result = client.until_result("floor")
        completion = result.completions[0]
        assert completion.finish_reason == "length" and all(math.isfinite(x) for x in completion.logprobs)
    finally:
        client.close()

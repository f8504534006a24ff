"""Cases from the speculative-decoding differential fuzzer (a plain engine and a `speculative="suffix"` one run the
same workload): ends that fall inside an accepted run of drafts (a stop token, a stop string, max_new_tokens), a
cancel and a weight update (each mode) while drafted samples run. Each compares the drafted engine's samples with the
plain engine's (bit for bit under `batch_invariant=True`), and checks that drafts were accepted, so the comparison
could fail."""

from __future__ import annotations

import copy

import pytest
from test_speculative import MODEL, TOKENIZER

from conftest import make_prompts, run_to_completion
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.speculative import drafter as drafter_module

PROMPT = make_prompts(1, 7, 7, seed=2)[0]
GREEDY = dict(temperature=0.0, seed=0)


@pytest.fixture(autouse=True)
def every_draft(monkeypatch):
    """Draft whatever matches (the acceptance gates would keep most drafts of these short runs back)."""
    monkeypatch.setattr(drafter_module, "MIN_ACCEPTANCE", 0.0)


def engine(speculative: str | None, **config) -> Engine:
    settings = dict(num_blocks=128, block_size=4, batch_invariant=True, speculative_disable_by_batch_size=64)
    settings.update(config)
    return Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(**settings, speculative=speculative),
                  tokenizer=TOKENIZER)  # fmt: skip


def outputs_of(outputs) -> dict:
    return {
        key: (list(out.generated_tokens), list(out.logprobs), out.finish_reason, out.policy_versions)
        for key, out in outputs.items()
    }


def greedy_reference(max_new_tokens: int = 24) -> list[int]:
    """The prompt's greedy continuation on the plain engine (what the drafted runs below draft from)."""
    plain = engine(None)
    plain.add_request("ref", PROMPT, SamplingParams(**GREEDY, stop_token_ids=[]), max_new_tokens=max_new_tokens)
    tokens = list(run_to_completion(plain)["ref"].generated_tokens)
    plain.close()
    return tokens


def run_with_pool(speculative: str | None, sampling: SamplingParams, max_new_tokens: int) -> tuple[dict, int]:
    """A greedy group of the prompt first (its samples fill the prompt's draft pool), then `sampling`'s group of
    the same prompt; that group's outputs and the drafts accepted for it."""
    served = engine(speculative)
    served.add_request("pool", PROMPT, SamplingParams(**GREEDY, stop_token_ids=[]), n=1, max_new_tokens=24)
    run_to_completion(served)
    before = served.scheduler.drafter.accepted_tokens if speculative else 0
    served.add_request("g", PROMPT, sampling, n=2, max_new_tokens=max_new_tokens)
    outputs = outputs_of(run_to_completion(served))
    accepted = served.scheduler.drafter.accepted_tokens - before if speculative else 0
    served.close()
    return outputs, accepted


@pytest.mark.parametrize("end", ["stop_token", "stop_string", "max_new_tokens"])
def test_an_end_inside_an_accepted_run_ends_the_sample_there(end):
    """Its drafts (the pool's whole greedy continuation) run past the end: the sample ends where plain decoding
    ends it, with the same tokens, log-probs and finish reason."""
    reference = greedy_reference()
    index = 13  # an output position past the first few drafted steps
    token = reference[index]
    first = reference.index(token)  # plain decoding ends at the token's first occurrence
    sampling, max_new_tokens = SamplingParams(**GREEDY, stop_token_ids=[]), 24
    if end == "stop_token":
        sampling = SamplingParams(**GREEDY, stop_token_ids=[token])
    elif end == "stop_string":
        text = TOKENIZER.decode(reference[first : first + 2])
        sampling = SamplingParams(**GREEDY, stop_token_ids=[], stop=[text])
    else:
        max_new_tokens = index
    (plain, _), (drafted, accepted) = (
        run_with_pool(None, sampling, max_new_tokens),
        run_with_pool("suffix", sampling, max_new_tokens),
    )
    assert accepted > 0, "drafts should be accepted, or nothing was compared"
    assert drafted == plain
    reasons = {reason for _, _, reason, _ in plain.values()}
    assert reasons == ({"length"} if end == "max_new_tokens" else {"stop"})
    assert all(len(tokens) < 24 for tokens, _, _, _ in plain.values())


def test_a_cancel_while_drafts_run_keeps_a_prefix_of_the_plain_samples():
    """A group cancelled a few steps in: each drafted sample's tokens (and log-probs) so far are the start of the
    plain engine's uncancelled sample."""
    sampling = SamplingParams(temperature=1.0, seed=4, stop_token_ids=[])
    plain, _ = run_with_pool(None, sampling, 24)
    served = engine("suffix")
    served.add_request("pool", PROMPT, SamplingParams(**GREEDY, stop_token_ids=[]), n=1, max_new_tokens=24)
    run_to_completion(served)
    served.add_request("g", PROMPT, sampling, n=2, max_new_tokens=24)
    for _ in range(6):
        served.step()
    cancelled = outputs_of({out.request_id: out for out in served.cancel("g") if out.is_finished})
    assert served.scheduler.drafter.accepted_tokens > 0
    served.close()
    assert sorted(cancelled) == sorted(plain)
    for key, (tokens, logprobs, reason, _) in cancelled.items():
        assert reason == "abort" and 0 < len(tokens) < 24
        assert (tokens, logprobs) == (plain[key][0][: len(tokens)], plain[key][1][: len(tokens)]), key


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_a_weight_update_while_drafts_run(mode):
    """The head's weights change a few steps into a drafted group (each commit mode). Tokens sampled under the old
    weights are the plain engine's under the old weights; a group started after the update equals the plain
    engine's under the new weights, bit for bit."""
    sampling = SamplingParams(temperature=1.0, seed=6, stop_token_ids=[])

    def run(speculative):
        served = engine(speculative)
        served.add_request("pool", PROMPT, SamplingParams(**GREEDY, stop_token_ids=[]), max_new_tokens=24)
        run_to_completion(served)
        served.add_request("before", PROMPT, sampling, n=2, max_new_tokens=24)
        finished = {}
        for _ in range(5):
            finished.update({out.request_id: out for out in served.step() if out.is_finished})
        weight = served.model.get_output_embeddings().weight
        result = served.update_weights({"lm_head.weight": weight * 1.05}, mode=mode, partial=True)
        finished.update({out.request_id: out for out in result.outputs})
        finished.update(run_to_completion(served))
        served.add_request("after", PROMPT, sampling, max_new_tokens=24)
        finished.update(run_to_completion(served))
        accepted = served.scheduler.drafter.accepted_tokens if speculative else 0
        served.close()
        return outputs_of(finished), accepted

    (plain, _), (drafted, accepted) = run(None), run("suffix")
    assert accepted > 0 and sorted(drafted) == sorted(plain)
    for key in ("before#0", "before#1"):
        (plain_tokens, plain_logprobs, _, plain_versions), (tokens, logprobs, _, versions) = plain[key], drafted[key]
        split = min(
            versions[1][1] if len(versions) > 1 else len(tokens),
            plain_versions[1][1] if len(plain_versions) > 1 else len(plain_tokens),
        )
        assert split > 0 and tokens[:split] == plain_tokens[:split] and logprobs[:split] == plain_logprobs[:split]
    assert drafted["after"] == plain["after"]


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_a_weight_update_with_clear_on_update_forgets_every_draft(mode):
    """`speculative_clear_on_weight_update=True` forgets every draft at the update, in every mode: the samples an
    "abort" update ends (drawn under the old weights) are no drafts afterwards either."""
    served = engine("suffix", speculative_clear_on_weight_update=True)
    served.add_request("pool", PROMPT, SamplingParams(**GREEDY, stop_token_ids=[]), max_new_tokens=24)
    run_to_completion(served)
    served.add_request("running", PROMPT, SamplingParams(temperature=1.0, seed=6, stop_token_ids=[]), n=2,
                       max_new_tokens=24)  # fmt: skip
    for _ in range(3):
        served.step()
    assert served.scheduler.drafter.num_pools == 1
    weight = served.model.get_output_embeddings().weight
    result = served.update_weights({"lm_head.weight": weight * 1.05}, mode=mode, partial=True)
    assert [output.finish_reason for output in result.outputs] == (["abort", "abort"] if mode == "abort" else [])
    assert served.scheduler.drafter.num_pools == 0
    served.close()

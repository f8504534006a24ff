"""The sampler's per-slot tables and draws: every processor at once gives the distribution transformers' processors
give, and the same tokens and log-probs whether the cache preempts (recompute, swap) or steps overlap, in groups;
the slot tables hold each sample's own tokens through preemption, and are freed once no sample uses them; the blocked
CDF walk draws what a whole-row walk draws; top_k candidates keep every token tied with the k-th, as transformers
does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import expected_logprobs
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import SamplingParams
from rollout.engine.sampling.draw import sample_blocked, sample_from, uniforms
from rollout.engine.sampling.sampler import Sampler

STOPS = (3, 17, 29, 41)
MAX_NEW = 16
EVERY_PROCESSOR = SamplingParams(
    temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.3,
    frequency_penalty=0.2, no_repeat_ngram_size=2, bad_words_ids=((5,), (9, 11), (20, 21, 22)), suppress_tokens=(7,),
    begin_suppress_tokens=(8,), min_new_tokens=4, stop_token_ids=STOPS, top_logprobs=3, seed=1,
)  # fmt: skip
# "top_k": every sampling request sets top_k (the sampler draws from candidates); "mixed": some do not (whole
# rows, with a blocked CDF walk), with every logprob_mode.
WORKLOADS = {
    "top_k": {
        "every": EVERY_PROCESSOR,
        "ngram3": SamplingParams(temperature=1.1, top_k=50, no_repeat_ngram_size=3, top_logprobs=2, seed=2),
        "typical": SamplingParams(top_k=60, typical_p=0.8, epsilon_cutoff=0.001, eta_cutoff=0.002, seed=3),
        "greedy": SamplingParams(temperature=0, repetition_penalty=1.2, no_repeat_ngram_size=1, top_logprobs=2),
        "raw": SamplingParams(temperature=0.7, top_k=20, frequency_penalty=0.5, logprob_mode="raw", seed=4),
    },
    "mixed": {
        "every": EVERY_PROCESSOR.merged(top_k=0),
        "ngram3": SamplingParams(temperature=1.1, top_k=50, no_repeat_ngram_size=3, top_logprobs=2, seed=2),
        "words": SamplingParams(bad_words_ids=((1, 2), (4, 5, 6)), presence_penalty=1.0, min_p=0.1, seed=5),
        "scaled": SamplingParams(
            temperature=0.8, top_p=0.8, repetition_penalty=0.8, logprob_mode="temperature_scaled", seed=6
        ),
        "greedy": SamplingParams(do_sample=False, suppress_tokens=(0, 1), min_new_tokens=3, stop_token_ids=STOPS),
    },
}


def run_workload(workload: str, **config) -> dict:
    engine = make_engine(tiny_model("qwen3"), **config)
    prompts = make_prompts(len(WORKLOADS[workload]), 5, 25, seed=3)
    for (name, params), prompt in zip(WORKLOADS[workload].items(), prompts):
        params = params if params.stop_token_ids is not None else params.merged(stop_token_ids=())
        engine.add_request(name, prompt, params, n=2, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    if "num_blocks" in config:
        assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    state = engine.sampler.slots.state
    assert not any(state.users.values()) and state.seen is None and state.history is None, "tables left"
    return outputs


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_processor_matches_transformers_under_preemption_and_overlap(workload):
    """Every processor, groups of two (a group's samples share their leader's first row): a cache that preempts
    (recompute with overlapped scheduling, swap) gives a roomy sequential run's tokens, top log-prob ids and log-probs
    (to fp32 rounding), and the "processed" log-probs are transformers' processors applied to a teacher-forced
    forward."""
    reference = run_workload(workload, overlap_scheduling=False)
    tight = {"num_blocks": 30, "max_batch_tokens": 24}
    runs = {
        "overlap, recompute": run_workload(workload, overlap_scheduling=True, **tight),
        "swap": run_workload(workload, cpu_offload_space=0.01, **tight),
    }
    assert {o.finish_reason for o in reference.values()} >= {"length"}
    for name, outputs in runs.items():
        assert outputs.keys() == reference.keys()
        for request_id, expected in reference.items():
            got = outputs[request_id]
            where = (name, request_id)
            assert got.generated_tokens == expected.generated_tokens, where
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5), where
            assert [[i for i, _ in t] for t in got.top_logprobs] == [[i for i, _ in t] for t in expected.top_logprobs]
    model = reference_copy(tiny_model("qwen3"))
    prompts = make_prompts(len(WORKLOADS[workload]), 5, 25, seed=3)
    outputs = runs["overlap, recompute"]
    for (name, params), prompt in zip(WORKLOADS[workload].items(), prompts):
        if params.logprob_mode != "processed":
            continue
        for index in range(2):
            out = outputs[f"{name}#{index}"]
            _, processed = expected_logprobs(model, prompt, out.generated_tokens, params)
            expected = processed.gather(1, torch.tensor(out.generated_tokens).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5), (name, index)


def test_slot_tables_hold_each_samples_tokens_through_preemption():
    """After every step (overlap off: every token on the host) each live sample's rows hold exactly its tokens:
    its history is its tokens, its seen row their set, its counts the counts of its output, whether it runs, waits
    after a preemption (recompute) or was forked from a group leader."""
    engine = make_engine(tiny_model("qwen3"), num_blocks=30, max_batch_tokens=24)
    prompts = make_prompts(3, 5, 25, seed=4)
    plain = SamplingParams(temperature=0.8, seed=9, stop_token_ids=())  # keeps no state: its rows are never read
    engine.add_request("c", prompts[2], plain, n=2, max_new_tokens=MAX_NEW)  # the oldest: preempted last
    engine.add_request("a", prompts[0], EVERY_PROCESSOR, n=3, max_new_tokens=MAX_NEW)
    engine.add_request("b", prompts[1], EVERY_PROCESSOR.merged(no_repeat_ngram_size=3, seed=8), max_new_tokens=MAX_NEW)
    state = engine.sampler.slots.state
    checked = set()
    while engine.has_unfinished():
        engine.step()
        scheduler = engine.scheduler
        for request in scheduler.running + list(scheduler.waiting) + list(scheduler.swapped):
            if request.sampling_slot < 0 or request.group_id == "c":
                continue
            slot, tokens = request.sampling_slot, torch.tensor(request.token_ids)
            assert torch.equal(state.history[slot, : len(tokens)], tokens), request.request_id
            seen = torch.zeros(engine.vocab_size, dtype=torch.bool)
            seen[tokens] = True
            assert torch.equal(state.seen[slot], seen), request.request_id
            counts = torch.bincount(torch.tensor(request.output_ids, dtype=torch.long), minlength=engine.vocab_size)
            assert torch.equal(state.counts[slot], counts.float()), request.request_id
            checked.add((request.request_id, request in scheduler.waiting, request.num_output_tokens > 0))
    assert engine.scheduler.num_preemptions > 0
    assert any(waiting and generated for _, waiting, generated in checked), "no preempted sample was checked"
    assert {request_id for request_id, _, _ in checked} >= {"a#0", "a#1", "a#2", "b"}
    assert state.seen is None and state.history is None and not any(state.users.values())


def test_blocked_cdf_walk_draws_what_a_whole_row_walk_draws():
    """sample_blocked finds the block, then the column, that sample_from finds over the whole row, for any block
    size (a ragged last block included), and never a zero-probability column."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(2000, 300, generator=generator) ** 4
    probs[torch.rand(probs.shape, generator=generator) < 0.7] = 0.0
    probs[:, 0] = 0.0
    probs[:5, 7:] = 0.0  # rows whose mass sits in the first block
    probs[:5, 3] = 0.5
    probs[5:10, :290] = 0.0  # ... and in the ragged last one
    probs[5:10, 295] = 0.5
    uniform = torch.from_numpy(uniforms(np.full(2000, 11, dtype=np.uint64), np.arange(2000)))
    expected = sample_from(probs, uniform)
    for block in (1, 7, 64, 299, 300, 1024):
        drawn = sample_blocked(probs, uniform, block)
        assert torch.equal(drawn, expected), block
        assert (probs.gather(1, drawn.unsqueeze(1)) > 0).all(), block


def test_candidates_keep_every_token_tied_with_the_kth():
    """top_k keeps every token whose score ties the k-th (transformers' semantics): drawing from candidates keeps
    them with transformers' probabilities (TopK then TopP warpers), and draws the tokens a whole row draws (the
    step a row without top_k beside makes)."""
    from conftest import make_request

    vocab = 200
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) - 5
    logits[0, [150, 3, 77, 120, 9, 60]] = torch.tensor([4.0, 3.0, 2.0, 2.0, 2.0, 2.0])  # k = 3: four tie at 2.0
    params = {"top_k": 3, "top_p": 0.99, "top_logprobs": 8, "seed": 5}
    warped = TopPLogitsWarper(0.99)(None, TopKLogitsWarper(3)(None, logits.clone()))
    expected = torch.log_softmax(warped, dim=-1)[0]
    candidates, whole_rows = Sampler(vocab, "cpu"), Sampler(vocab, "cpu")
    tokens = []
    for position in range(120):
        prompt = list(range(1, 2 + position))
        request, same = make_request("r", prompt, max_new_tokens=4, **params), make_request("r", prompt, **params)
        output = candidates.sample(logits, [(request, 0)], True).fetch()
        beside = make_request("plain", [1], top_logprobs=8, seed=1)  # no top_k: the step draws whole rows
        whole = whole_rows.sample(logits.expand(2, vocab), [(same, 0), (beside, 1)], True).fetch()
        for sampler, done in ((candidates, [request]), (whole_rows, [same, beside])):
            for finished in done:
                sampler.release(finished)
        tokens.append(output.token_ids[0])
        assert output.token_ids[0] == whole.token_ids[0], position
        for top in (output.top_logprobs[0], whole.top_logprobs[0]):
            kept = {i: v for i, v in top if v > float("-inf")}
            assert kept.keys() == {150, 3, 77, 120, 9, 60}, position
            assert all(abs(v - expected[i].item()) < 1e-6 for i, v in kept.items()), position
    assert set(tokens) == {150, 3, 77, 120, 9, 60}


@pytest.mark.parametrize("top_k", [0, 3], ids=["whole-rows", "candidates"])
def test_top_p_drops_what_transformers_drops_at_its_threshold(top_k):
    """top_p=0.95 on a row whose cumulative probability after its two smallest tokens, 0.0500000082 in fp32, lies
    between fp32(1 - 0.95), the threshold transformers' TopPLogitsWarper compares with, and 1 - fp32(0.95): token 0
    is kept, as transformers keeps it (a threshold computed in fp32 dropped it), whole rows or candidates."""
    from conftest import make_request

    row = torch.tensor([[0.0, 2.9444448947906494, -11.991397857666016]])
    cumulative = row.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)[0, 1]
    assert torch.tensor(1 - 0.95, dtype=torch.float32) < cumulative <= torch.tensor(1.0) - torch.tensor(0.95)
    expected = torch.log_softmax(TopPLogitsWarper(0.95)(None, row.clone()), dim=-1)[0]
    assert expected[0] > float("-inf") and expected[2] == float("-inf")
    request = make_request("r", [1, 2], top_p=0.95, top_k=top_k, top_logprobs=3, seed=0)
    top = dict(Sampler(3, "cpu").sample(row, [(request, 0)], True).fetch().top_logprobs[0])
    assert [top[token] for token in range(3)] == pytest.approx(expected.tolist(), abs=1e-6)


def _kept(row: torch.Tensor, params: dict, beside: dict | None = None) -> list[int]:
    """The tokens a fresh Sampler keeps for `row` (the processed distribution's finite top log-probs); with `beside`,
    a second live sample of those parameters is in the step (one without top_k makes the step draw whole rows)."""
    from conftest import make_request

    vocab = row.shape[1]
    samples = [(make_request("r", [1, 2], top_logprobs=vocab, seed=0, **params), 0)]
    if beside is not None:
        samples.append((make_request("b", [1, 2], seed=1, **beside), 1))
    output = Sampler(vocab, "cpu").sample(row.expand(len(samples), vocab), samples, True).fetch()
    return sorted(token for token, value in output.top_logprobs[0] if value > float("-inf"))


def test_eta_cutoff_cuts_where_transformers_cuts():
    """eta_cutoff set to a token's own probability: transformers' EtaLogitsWarper keeps it (its cut compares
    softmax(scores), with Categorical's entropy); so does the sampler, whole rows or candidates (a cut computed on
    exp(log_softmax) dropped it)."""
    from transformers.generation.logits_process import EtaLogitsWarper

    row = torch.tensor([[0.0, -2.08, -6.48]])
    eta = row.softmax(-1)[0, 1].item()
    warped = EtaLogitsWarper(eta)(None, row.clone())
    expected = [token for token in range(3) if warped[0, token] > float("-inf")]
    assert expected == [0, 1]
    assert _kept(row, {"eta_cutoff": eta}) == expected
    assert _kept(row, {"eta_cutoff": eta, "top_k": 3}) == expected


def test_tokens_tied_at_the_top_p_boundary_are_kept_alike_whatever_the_batch():
    """Two tokens tie above a flat tail, top_k=2 keeps both, top_p=0.5 keeps one: the same one (the higher id, sorts
    being stable) whether the step draws from candidates (every live sample sets top_k) or whole rows (another live
    sample sets none); a completion does not depend on the other samples."""
    row = torch.zeros(1, 80)
    row[0, 0] = row[0, 2] = 1.0
    params = {"top_k": 2, "top_p": 0.5}
    alone = _kept(row, params)
    assert alone == _kept(row, params, beside={"top_p": 0.9}) == [2]

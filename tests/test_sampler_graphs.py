"""The sampler's captured passes (`SamplerGraphs`), run on CPU with capture off: the same buffers, padding, buckets
and decisions as on a GPU, the pass run again on the buffers where a GPU replays it. Tokens, log-probs and top
log-probs equal the eager sampler's bit for bit over greedy and sampled groups, top log-probs, every logprob_mode,
preemption and overlapped steps; a pass is captured again when a decision it made changes (a new processor among the
live samples, the parameter tables moved), and never serves a step that reads other tables (penalties, bans). Drafted
steps (speculative decoding: a sample's draws ahead on its draft rows) replay passes too."""

from __future__ import annotations

import pytest

from conftest import make_engine, make_prompts, run_to_completion, tiny_model
from rollout.config import SamplingParams

MODEL = tiny_model("qwen3")
STOPS = (3, 17)

GRAPHABLE = {
    "greedy": SamplingParams(do_sample=False, stop_token_ids=STOPS, top_logprobs=2),
    "grpo": SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1, stop_token_ids=STOPS),
    "scaled": SamplingParams(temperature=0.7, top_p=0.8, logprob_mode="temperature_scaled", seed=2, top_logprobs=3),
    "raw": SamplingParams(temperature=1.1, min_p=0.05, logprob_mode="raw", seed=3, stop_token_ids=()),
    "typical": SamplingParams(top_k=40, typical_p=0.9, epsilon_cutoff=0.001, seed=4, stop_token_ids=()),
}


def run(
    settings: dict[str, SamplingParams], graphs: bool, n: int = 3, lengths: dict | None = None, **config
) -> tuple[dict, object]:
    """Every setting's group, all at once (16 new tokens, or its `lengths` entry); outputs keyed by sample, and the
    engine (closed)."""
    engine = make_engine(MODEL, **config)
    if graphs:
        engine.sampler.enable_graphs([1, 2, 4, 8, 16, 32], capture=False)
    for (name, params), prompt in zip(settings.items(), make_prompts(len(settings), 4, 20, seed=7)):
        engine.add_request(name, prompt, params, n=n, max_new_tokens=(lengths or {}).get(name, 16))
    outputs = run_to_completion(engine)
    engine.close()
    results = {key: (out.generated_tokens, out.logprobs, out.top_logprobs) for key, out in outputs.items()}
    return results, engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "invariant"])
def test_captured_passes_give_the_eager_samplers_tokens_and_logprobs(overlap, batch_invariant):
    config = dict(overlap_scheduling=overlap, batch_invariant=batch_invariant, num_blocks=30, max_batch_tokens=24)
    eager, _ = run(GRAPHABLE, False, **config)
    graphed, engine = run(GRAPHABLE, True, **config)
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to preempt"
    assert engine.sampler.graphs.replays >= engine.counters.steps // 2, "most steps should replay a pass"
    assert graphed == eager


def test_a_pass_is_captured_again_when_a_decision_changes():
    """A group that asks for top_p joins samples that did not: the pass captured without top_p does not serve (its
    decisions differ); when that group ends, the first pass serves again, and the tokens stay the eager ones."""
    settings = {"plain": SamplingParams(temperature=1.0, seed=5, stop_token_ids=())}
    engine = make_engine(MODEL)
    graphs = engine.sampler.enable_graphs([4], capture=False)
    prompts = make_prompts(2, 4, 10, seed=9)
    engine.add_request("plain", prompts[0], settings["plain"], n=2, max_new_tokens=24)
    for _ in range(4):
        engine.step()
    first = graphs.captures
    engine.add_request("top_p", prompts[1], SamplingParams(temperature=1.0, top_p=0.5, seed=6), n=2, max_new_tokens=4)
    outputs = run_to_completion(engine)
    assert graphs.captures > first
    assert graphs.num_captured == graphs.captures  # the first capture served again after top_p's group ended
    engine.close()

    reference = make_engine(MODEL)
    reference.add_request("plain", prompts[0], settings["plain"], n=2, max_new_tokens=24)
    for _ in range(4):
        reference.step()
    reference.add_request("top_p", prompts[1], SamplingParams(temperature=1.0, top_p=0.5, seed=6), n=2,
                          max_new_tokens=4)  # fmt: skip
    expected = run_to_completion(reference)
    reference.close()
    assert {k: v.generated_tokens for k, v in outputs.items()} == {k: v.generated_tokens for k, v in expected.items()}


def test_a_sample_without_top_k_joining_top_k_ones_does_not_replay_their_candidates_pass():
    """With a top_k sample and a greedy one live, the pass draws from top_k candidates; a sampled request without
    top_k then joins: that decision (whether every sampled slot sets top_k) is recorded, so the captured candidates
    pass does not serve it (it would draw the newcomer from top_k candidates too), and the tokens are the eager
    sampler's."""
    prompts = make_prompts(3, 5, 9, seed=4)
    top_k = SamplingParams(temperature=1.0, top_k=5, seed=1, stop_token_ids=())
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    newcomer = SamplingParams(temperature=1.0, seed=2, stop_token_ids=())

    def tokens(graphs: bool) -> tuple[dict, int]:
        engine = make_engine(MODEL)
        # One bucket: the steps before the newcomer and with it use the same one (a key of its own would hide it).
        sampler_graphs = engine.sampler.enable_graphs([4], capture=False) if graphs else None
        engine.add_request("top_k", prompts[0], top_k, max_new_tokens=20)
        engine.add_request("greedy", prompts[1], greedy, max_new_tokens=20)
        for _ in range(6):
            engine.step()
        captured = sampler_graphs.captures if graphs else 0
        engine.add_request("newcomer", prompts[2], newcomer, max_new_tokens=10)
        outputs = run_to_completion(engine)
        engine.close()
        return {key: out.generated_tokens for key, out in outputs.items()}, captured

    (graphed, captured), (eager, _) = tokens(True), tokens(False)
    assert captured > 0, "the candidates pass should be captured before the newcomer joins"
    assert graphed == eager


def test_penalties_and_bans_never_replay_a_pass_and_moved_tables_are_captured_again():
    """Penalties and bans read tables that come and go: their steps sample eagerly. When the parameter tables move
    (they grow when more samples arrive than they hold), a pass captured before does not serve after."""
    mixed = dict(GRAPHABLE)
    mixed["penalized"] = SamplingParams(temperature=0.8, repetition_penalty=1.3, no_repeat_ngram_size=2, seed=8)
    eager, _ = run(mixed, False, lengths={"penalized": 4})
    graphed, engine = run(mixed, True, lengths={"penalized": 4})
    assert graphed == eager
    assert engine.sampler.graphs.replays > 0  # once the penalized group ended

    engine = make_engine(MODEL)
    graphs = engine.sampler.enable_graphs([4], capture=False)
    engine.add_request("g", make_prompts(1, 6, 6, seed=1)[0], GRAPHABLE["grpo"], n=2, max_new_tokens=12)
    for _ in range(4):
        engine.step()
    captured = graphs.captures
    engine.sampler.slots._grow()  # noqa: SLF001 - the tables move, as when more samples arrive than they hold
    outputs = run_to_completion(engine)
    assert graphs.captures == captured + 1 and graphs.replays > 4
    engine.close()
    reference = make_engine(MODEL)
    reference.add_request("g", make_prompts(1, 6, 6, seed=1)[0], GRAPHABLE["grpo"], n=2, max_new_tokens=12)
    expected = run_to_completion(reference)
    reference.close()
    assert {k: v.generated_tokens for k, v in outputs.items()} == {k: v.generated_tokens for k, v in expected.items()}


def test_drafted_steps_replay_passes_and_keep_their_tokens(monkeypatch):
    """Speculative decoding on a low-entropy model: drafted steps pick each sample's rows (its first and its draft
    positions) into the buffers and replay a pass; tokens and log-probs equal the eager sampler's, bit for bit."""
    from test_speculative import low_entropy_model

    from rollout.engine.speculative import drafter

    monkeypatch.setattr(drafter, "MIN_ACCEPTANCE", 0.0)  # draft whatever matches: these runs are short
    model = low_entropy_model()
    settings = {
        "grpo": SamplingParams(temperature=1.0, top_p=0.95, seed=1, stop_token_ids=()),
        "greedy": SamplingParams(do_sample=False, stop_token_ids=(), top_logprobs=2),
    }
    results = []
    for graphs in (True, False):
        engine = make_engine(model, speculative="suffix", batch_invariant=True, num_blocks=160)
        if graphs:
            sampler_graphs = engine.sampler.enable_graphs([4, 8, 16, 32], capture=False)
        outputs = {}
        for round_index in range(2):  # the second round drafts from the first
            for (name, params), prompt in zip(settings.items(), make_prompts(2, 4, 10, seed=3)):
                engine.add_request(f"{name}{round_index}", prompt, params, n=4, max_new_tokens=24)
            outputs.update(run_to_completion(engine))
        if graphs:
            assert engine.scheduler.drafter.accepted_tokens > 0, "drafts should be accepted"
            replays = sampler_graphs.replays
        engine.close()
        results.append({key: (out.generated_tokens, out.logprobs, out.top_logprobs) for key, out in outputs.items()})
    assert results[0] == results[1]
    assert replays > 0

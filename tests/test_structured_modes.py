"""Structured outputs through the engine's modes: preemption (swap and recompute), weight updates (keep, recompute,
abort, wait), streaming and cancel, overlap scheduling, and `ColocatedEngine`.

A sample's grammar state lives with its request: preemption and re-prefill keep its tokens, so they keep its state.
References: the same requests on a roomy cache (preemption must change no token), the grammar's own acceptance
(`re.fullmatch`; xgrammar's matcher for the prefix an abort leaves). That batches without constraints stay free of
host reads is `test_overlap.py::test_launching_a_step_never_reads_the_device` (the sampler's grammar check included)."""

from __future__ import annotations

import re

import pytest

xgrammar = pytest.importorskip("xgrammar")

from conftest import run_to_completion  # noqa: E402
from rollout import ContinuousBatchingConfig, SamplingParams  # noqa: E402
from rollout.engine.engine import Engine  # noqa: E402
from rollout.engine.manager.continuous_batching import init_continuous_batching  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from trainer_bridge import PromptGroup  # noqa: E402
from trainer_bridge.colocated import ColocatedEngine  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKENIZER = tiny_tokenizer()
MODEL = tiny_model(0)
WORDS = r"[a-z]{6}( [a-z]{6}){4}"  # 34 characters: long enough to be preempted mid-way, short enough to end
PROMPTS = [TOKENIZER(text)["input_ids"] for text in ("one", "two words", "three more words", "four")]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=48, regex=WORDS, seed=7)


def engine(**config) -> Engine:
    config.setdefault("num_blocks", 256)
    config.setdefault("block_size", 4)
    return Engine(MODEL, ContinuousBatchingConfig(**config), tokenizer=TOKENIZER)


def texts(outputs: dict) -> dict[str, str]:
    return {rid: TOKENIZER.decode(o.generated_tokens, skip_special_tokens=True) for rid, o in outputs.items()}


def valid_prefix(tokens: list[int], pattern: str) -> bool:
    """xgrammar's own matcher accepts every token (the prefix an abort leaves can still become a match)."""
    info = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=MODEL.config.vocab_size)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex(pattern))
    return all(matcher.accept_token(token) for token in tokens)


def add_all(target: Engine, n: int = 2) -> None:
    for index, prompt in enumerate(PROMPTS):
        target.add_request(f"g{index}", prompt, SAMPLED, n=n)


def test_preemption_by_swap_and_recompute_changes_no_constrained_token():
    roomy = engine()
    add_all(roomy)
    expected = run_to_completion(roomy)
    for swap in (0.0, 0.01):  # recompute (freed and re-prefilled), then swapped to CPU blocks (GiB)
        tight = engine(num_blocks=20, cpu_offload_space=swap)
        add_all(tight)
        got = run_to_completion(tight)
        assert tight.scheduler.num_preemptions > 0 and (tight.scheduler.num_swaps > 0) == (swap > 0)
        assert {rid: o.generated_tokens for rid, o in got.items()} == {
            rid: o.generated_tokens for rid, o in expected.items()
        }
    assert all(re.fullmatch(WORDS, text) for text in texts(expected).values())
    assert all(o.finish_reason == "stop" for o in expected.values())
    roomy.close()  # its grammar buffer and compiled grammars go with it, not with a garbage collection
    assert roomy.sampler.grammar_masks._buffer is None and not roomy.intake.grammars._compilers


def test_overlap_scheduling_changes_no_constrained_token():
    """Overlapped, a constrained step's tokens are fetched while the next forward runs and the next masks filled
    from them (a sample whose grammar ended has one more row, dropped): the tokens are the sequential engine's, with
    unconstrained samples and preemption beside."""

    def run(**config) -> dict:
        target = engine(num_blocks=24, **config)
        add_all(target)
        target.add_request("free", PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=20, seed=3), n=2)
        outputs = run_to_completion(target)
        assert target.scheduler.num_preemptions > 0
        return {rid: (o.generated_tokens, o.finish_reason) for rid, o in outputs.items()}

    expected = run(overlap_scheduling=False)
    assert run(overlap_scheduling=True) == expected
    constrained = [
        TOKENIZER.decode(tokens, skip_special_tokens=True) for rid, (tokens, _) in expected.items() if rid[0] == "g"
    ]
    assert len(constrained) == 8 and all(re.fullmatch(WORDS, text) for text in constrained)


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_a_weight_update_mid_generation_keeps_every_sample_in_its_grammar(mode):
    target = engine()
    add_all(target)
    for _ in range(6):
        target.step()
    in_flight = {r.request_id: r.num_output_tokens for r in target.scheduler.running}
    assert in_flight and all(count > 0 for count in in_flight.values())
    target.update_weights(tiny_model(1).state_dict(), mode=mode)
    outputs = run_to_completion(target)
    for rid, output in outputs.items():
        if mode == "abort":
            assert output.finish_reason == "abort" and valid_prefix(output.generated_tokens, WORDS), rid
        else:
            assert output.finish_reason == "stop", rid
            assert re.fullmatch(WORDS, TOKENIZER.decode(output.generated_tokens, skip_special_tokens=True)), rid
            assert output.policy_versions[-1][0] == 1  # the last tokens came from the new weights


@pytest.mark.parametrize("overlap", [False, True])
def test_manager_streaming_cancel_and_a_draining_update_with_constraints(overlap):
    config = ContinuousBatchingConfig(num_blocks=256, block_size=4, overlap_scheduling=overlap)
    with init_continuous_batching(MODEL, continuous_batching_config=config, tokenizer=TOKENIZER) as manager:
        with manager.pause():  # queued together, so they share steps
            manager.add_request(PROMPTS[0], request_id="streamed", sampling=SAMPLED, streaming=True)
            manager.add_request(PROMPTS[1], request_id="cancelled", sampling=SAMPLED.merged(max_new_tokens=400))
            manager.add_request(PROMPTS[2], request_id="plain", max_new_tokens=40, do_sample=True)
        deltas = list(manager.request_id_iter("streamed", timeout=60))
        streamed = [token for delta in deltas for token in delta.generated_tokens]
        assert deltas[-1].finish_reason == "stop" and len(deltas) == len(streamed)
        assert re.fullmatch(WORDS, TOKENIZER.decode(streamed, skip_special_tokens=True))
        manager.cancel_request("cancelled")
        cancelled = manager.get_result("cancelled", timeout=60)
        assert cancelled.finish_reason in ("abort", "stop")
        assert valid_prefix(cancelled.generated_tokens, WORDS)
        assert manager.get_result("plain", timeout=60).finish_reason == "length"
        manager.add_request(PROMPTS[3], request_id="drained", sampling=SAMPLED, n=2)
        manager.update_weights(tiny_model(1).state_dict(), mode="wait", timeout=60)
        for _ in range(2):
            output = manager.get_result("drained", timeout=60)
            assert output.policy_versions == [[0, 0]]  # finished under the old weights before the update
            assert re.fullmatch(WORDS, TOKENIZER.decode(output.generated_tokens, skip_special_tokens=True))


def test_colocated_engine_honours_constraints():
    config = ContinuousBatchingConfig(num_blocks=256, block_size=4)
    colocated = ColocatedEngine(MODEL, config, tokenizer=TOKENIZER)
    try:
        groups = colocated.generate([PromptGroup(PROMPTS[0], n=4, sampling=SAMPLED)])
    finally:
        colocated.close()
    completions = groups[0].completions
    assert len(completions) == 4
    assert all(re.fullmatch(WORDS, TOKENIZER.decode(c.token_ids, skip_special_tokens=True)) for c in completions)

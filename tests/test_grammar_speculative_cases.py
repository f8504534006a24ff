"""Structured outputs under their CPU bounds (grammar/cpu_bounds.py) where speculative decoding drafts, and under a
long min_new_tokens: a sample whose grammar is found too slow inside an accepted run of drafts ends at the token a
plain run ends it at, its siblings go on, and the drafter stops spending its grammar's CPU; a long array under
`maxItems` whose min_new_tokens look-ahead pays the matcher's buffer growth is not ended for it.

The CPU bounds are time bounds, so a test that lets real time decide where a sample ends could not compare a drafted
run with a plain one token for token: here a watch reports one chosen accept as past the bound (the watch's own rule
then decides), or the bounds are lowered. References: xgrammar's own GrammarMatcher (it takes every token a sample
kept), the engine without speculation (bit for bit under `batch_invariant=True`)."""

from __future__ import annotations

import copy

import pytest

from conftest import make_request, run_to_completion

xgrammar = pytest.importorskip("xgrammar")

from rollout import ContinuousBatchingConfig, SamplingParams  # noqa: E402
from rollout.engine.engine import Engine  # noqa: E402
from rollout.engine.grammar import cpu_bounds  # noqa: E402
from rollout.engine.speculative import drafter as drafter_module  # noqa: E402
from rollout.engine.speculative.drafter import SuffixDrafter  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TOKENIZER = tiny_tokenizer()
MODEL = tiny_model(0)
VOCAB = MODEL.config.vocab_size
INFO = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB)
EOS = TOKENIZER.eos_token_id
PROMPT = TOKENIZER("x: ")["input_ids"]
NESTED = 'root ::= ((((("a")+)+)+)+)+'  # its matcher's state grows with every "a" it accepts
MAX_NEW = 20


def reference_takes(compiled, tokens: list[int]) -> bool:
    """xgrammar's own matcher, fresh, takes every token."""
    matcher = xgrammar.GrammarMatcher(compiled)
    return all(matcher.accept_token(token) for token in tokens)


class SlowAt(cpu_bounds.CpuWatch):
    """A watch told that the accept after `at` tokens took twice the bound (the watch's own rule finds it too slow),
    so a drafted run and a plain run find the same token too slow."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def accepted(self, seconds: float, generated: int) -> None:
        super().accepted(2 * cpu_bounds.MAX_ACCEPT_S if generated == self.at else seconds, generated)


class CountingMatcher(xgrammar.GrammarMatcher):
    """xgrammar's matcher, counting the tokens it is asked to accept once its sample's watch found it too slow."""

    watch: cpu_bounds.CpuWatch
    late_accepts: int

    def accept_token(self, token_id: int, *args, **kwargs) -> bool:
        self.late_accepts += self.watch.too_slow is not None
        return super().accept_token(token_id, *args, **kwargs)


def run(speculative: bool, slow_at: dict[str, int], temperature: float) -> tuple[dict, int, dict]:
    """A greedy group filling the prompt's draft pool, then a streaming group of 4 whose samples `slow_at` names are
    found too slow after so many tokens: each sample's (streamed tokens, finish reason, error), the drafts accepted
    for the group, and the slow samples' matchers."""
    settings = dict(num_blocks=128, block_size=4, batch_invariant=True)
    if speculative:
        settings.update(speculative="suffix", num_speculative_tokens=4, speculative_disable_by_batch_size=64)
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(**settings), tokenizer=TOKENIZER)
    away_from_eos = ((EOS, -100.0),)
    engine.add_request("pool", PROMPT, SamplingParams(grammar=NESTED, logit_bias=away_from_eos, temperature=0.0), n=2,
                       max_new_tokens=MAX_NEW)  # fmt: skip
    run_to_completion(engine)
    before = engine.scheduler.drafter.accepted_tokens if speculative else 0
    sampling = SamplingParams(grammar=NESTED, logit_bias=away_from_eos, temperature=temperature, seed=0)
    engine.add_request("g", PROMPT, sampling, n=4, max_new_tokens=MAX_NEW, streaming=True)
    streamed: dict[str, list[int]] = {}
    final: dict[str, tuple] = {}
    slow: dict[str, CountingMatcher] = {}
    while engine.has_unfinished():
        for request in engine.scheduler.running + list(engine.scheduler.waiting):
            # once the group is forked (each sample's state fresh), before the chosen token
            if request.request_id in slow_at and request.request_id not in slow and request.constraint is not None:
                state = request.constraint
                assert state.generated < slow_at[request.request_id]
                state.watch = SlowAt(slow_at[request.request_id])
                matcher = slow[request.request_id] = state.matcher
                matcher.__class__ = CountingMatcher
                matcher.watch, matcher.late_accepts = state.watch, 0
        for output in engine.step():
            assert output.request_id not in final, "an output after the sample's last"
            streamed.setdefault(output.request_id, []).extend(output.generated_tokens)
            if output.is_finished:
                final[output.request_id] = (streamed[output.request_id], output.finish_reason, output.error)
    accepted = engine.scheduler.drafter.accepted_tokens - before if speculative else 0
    engine.close()
    assert slow.keys() == slow_at.keys()
    return final, accepted, slow


# Each slow position falls inside an accepted run of drafts or at its end (then the drafter is asked next).
@pytest.mark.parametrize(("temperature", "slow_at"), [(0.0, {"g#1": 5, "g#2": 10}), (1.0, {"g#1": 7, "g#3": 12})])
def test_a_grammar_found_too_slow_among_accepted_drafts_ends_its_sample_as_without_drafts(
    monkeypatch, temperature, slow_at
):
    """Two samples of a group are each found too slow at one token, inside an accepted run of drafts or at its end:
    with drafts, every sample's streamed tokens, finish reason and error are those of the plain run (a slow one ends
    with the CPU error just past its token, the others run to max_new_tokens), xgrammar's matcher takes every token,
    and once found too slow a matcher accepts nothing more (the drafter checked its next drafts on it: accepts slower
    than the one found too slow, before its sample ended)."""
    monkeypatch.setattr(drafter_module, "MIN_ACCEPTANCE", 0.0)  # draft whatever matches
    monkeypatch.setattr(cpu_bounds, "MAX_ACCEPT_S", 1.0)  # only the chosen accepts are too slow
    plain, _, _ = run(False, slow_at, temperature)
    drafted, accepted, slow = run(True, slow_at, temperature)
    assert accepted > 0, "no draft was accepted: the comparison would not test drafts"
    assert drafted == plain
    compiled = xgrammar.GrammarCompiler(INFO).compile_grammar(NESTED)
    for sample, (tokens, finish_reason, error) in drafted.items():
        assert reference_takes(compiled, tokens), sample
        if sample in slow_at:
            assert finish_reason == "error" and "CPU" in error and len(tokens) == slow_at[sample] + 1
        else:
            assert finish_reason == "length" and len(tokens) == MAX_NEW and error is None
    assert {sample: matcher.late_accepts for sample, matcher in slow.items()} == dict.fromkeys(slow_at, 0)


def drafting_grammar(regex: str, earlier: list[int], running: list[int]) -> tuple[SuffixDrafter, object, Engine]:
    """A drafter that knows a finished sample of `earlier` tokens and a running one at `running`, under `regex`."""
    drafter = SuffixDrafter(num_speculative_tokens=4, disable_by_batch_size=8, index_tokens=1000)
    drafter._rates = {length: [1.0, 1.0] for length in drafter._rates}  # every match length pays already
    finished = make_request("earlier", [1, 2, 3])
    finished.token_ids += earlier
    drafter.finished(finished)
    request = make_request("running", [1, 2, 3], max_new_tokens=20, regex=regex)
    request.token_ids += running
    engine = Engine(MODEL, ContinuousBatchingConfig(num_blocks=64), tokenizer=TOKENIZER)
    request.constraint = engine.intake.constraint(request.sampling)
    for token in running:
        request.constraint.accept(token)
    drafter.speculates(1)
    return drafter, request, engine


def test_the_drafters_grammar_check_stops_at_the_accept_bound(monkeypatch):
    """The check of a draft's tokens against the sample's grammar is that grammar's accepts done ahead: past the
    bound of one accept (lowered below anything here), the draft is cut after the accept that crossed it, where
    xgrammar's matcher would take all 4 tokens; a grammar found too slow gets no draft, and its matcher is left
    where it was."""
    a, b = TOKENIZER.convert_tokens_to_ids(["a", "b"])
    drafter, request, engine = drafting_grammar("(ab)+", [a, b, a, b, a, b, a, b], [a, b])
    reference = xgrammar.GrammarMatcher(request.constraint.compiled)
    assert all(reference.accept_token(token) for token in (a, b, a, b, a, b))
    assert drafter.propose(request, 4) == (a, b, a, b)  # the bound far off: the whole draft
    monkeypatch.setattr(cpu_bounds, "MAX_ACCEPT_S", -1.0)
    assert drafter.propose(request, 4) == (a,)
    monkeypatch.setattr(cpu_bounds, "MAX_ACCEPT_S", 1.0)
    request.constraint.watch.too_slow = 1.0
    assert drafter.propose(request, 4) == ()
    assert request.constraint.matcher.accept_token(a)  # left after "ab"
    engine.close()


def test_a_min_new_tokens_look_ahead_that_grows_a_buffer_is_let_through_as_an_accept_is():
    """`{"items": [...]}` with up to 100,000 integers and min_new_tokens past its end: each step's look-ahead tries
    its next tokens on the sample's own matcher, so it, not the accept, pays xgrammar's buffer growth each time the
    output about doubles (measured 7, 13, 24 and 95 ms at 2,200, 4,200, 8,300 and 32,500 tokens), while its other
    steps take about 1 ms. So a look-ahead past its bound is let through under the accept's allowance (at most
    SPIKE_S_PER_TOKEN per token so far, once per SPIKE_GROWTH-fold growth), and a second one soon after is not. (Fed
    the growths' costs, not timed here: a timed run depends on the machine's load.)"""
    watch = cpu_bounds.CpuWatch()
    growth = 0.5 * cpu_bounds.SPIKE_S_PER_TOKEN * 32_500  # past MAX_LOOK_AHEAD_S, under the allowance at 32,500
    assert growth > cpu_bounds.MAX_LOOK_AHEAD_S
    watch.looked_ahead(growth, 32_500)
    assert watch.too_slow is None  # a buffer's growth: the sample goes on
    watch.looked_ahead(growth, 32_600)  # no growth of the output since: a grammar too slow to follow
    assert watch.too_slow == growth and "look-ahead" in watch.reason()

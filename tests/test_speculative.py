"""Speculative decoding (`ContinuousBatchingConfig(speculative="suffix")`): drafts from the prompt's own samples,
verified by drawing every token as plain decoding draws it. With the same seeds, the tokens (and, under
`batch_invariant=True`, their log-probs, bit for bit) equal those of the same engine without speculation, for sampled
groups with penalties, bans, min_new_tokens, logit_bias and a grammar, over preemption and a weight update; the
log-probs equal a teacher-forced forward of transformers' model; drafts actually get accepted (so the comparison can
fail), and rejected drafts' KV never reaches the prefix cache."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_prompts, make_request, needs_triton_interpreter, run_to_completion
from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.engine.engine import Engine
from rollout.engine.speculative import drafter as drafter_module
from rollout.engine.speculative.drafter import SuffixDrafter
from rollout.engine.speculative.suffix_pool import DraftPool
from rollout.presets import tiny_model, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


def low_entropy_model(entropy: float = 0.3) -> torch.nn.Module:
    """The tiny preset scaled to a low mean next-token entropy: siblings agree, and the model repeats itself."""
    model = tiny_model(0)
    scale_to_entropy(model, make_prompts(6, 20, 40, seed=3), entropy)
    return model


MODEL = low_entropy_model()


@pytest.fixture
def every_draft(monkeypatch):
    """Draft whatever matches, however often drafts were rejected: every verification path runs (the drafter's
    acceptance gates would keep most drafts of these short runs back)."""
    monkeypatch.setattr(drafter_module, "MIN_ACCEPTANCE", 0.0)


def samplings() -> list[SamplingParams]:
    """One group per setting the verification must replay exactly."""
    common = dict(temperature=1.0, stop_token_ids=[EOS])
    return [
        SamplingParams(**common, seed=1, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1),
        SamplingParams(**common, seed=2, min_new_tokens=12, suppress_tokens=[5, 6], bad_words_ids=[[40, 41]]),
        SamplingParams(**common, seed=3, logit_bias={7: 2.0, 300: -1.0}, top_k=50, top_p=0.9),
        SamplingParams(**common, seed=4, regex=r"(ab|abc|c| )+"),
        SamplingParams(temperature=0.0, stop_token_ids=[EOS], seed=5),
    ]


def run_rounds(model: torch.nn.Module, speculative: str | None, **config) -> tuple[list[dict], Engine]:
    """Two rounds of the same prompts (n=4 each), a weight update between them; each sample's tokens, log-probs and
    versions per round (keyed by group and sample)."""
    settings = dict(num_blocks=160, block_size=4, max_batch_tokens=48, speculative_disable_by_batch_size=32)
    engine = Engine(model, ContinuousBatchingConfig(**settings, **config, speculative=speculative), tokenizer=TOKENIZER)
    if speculative is not None:  # drafts accepted per setting (group index), so each one's path is known to have run
        engine.accepted_by_setting = accepted = {}
        verified = engine.scheduler.drafter.verified

        def counted(request, proposed: int, taken: int) -> None:
            setting = int(request.group_id.rsplit("g", 1)[1])
            accepted[setting] = accepted.get(setting, 0) + taken
            verified(request, proposed, taken)

        engine.scheduler.drafter.verified = counted
    prompts = make_prompts(len(samplings()), 4, 10, seed=11)
    results = []
    for round_index in range(2):
        for index, (prompt, sampling) in enumerate(zip(prompts, samplings())):
            engine.add_request(f"r{round_index}g{index}", prompt, sampling, n=4, max_new_tokens=48)
        outputs = run_to_completion(engine)
        results.append(
            {
                key: (list(out.generated_tokens), list(out.logprobs), out.policy_versions, out.finish_reason)
                for key, out in outputs.items()
            }
        )
        if round_index == 0:
            weight = engine.model.get_output_embeddings().weight
            engine.update_weights({"lm_head.weight": weight * 1.05}, mode="keep", partial=True)
    return results, engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_same_seeds_give_the_same_tokens_and_logprobs_bit_for_bit(overlap, every_draft):
    plain, plain_engine = run_rounds(copy.deepcopy(MODEL), None, batch_invariant=True, overlap_scheduling=overlap)
    drafted, engine = run_rounds(copy.deepcopy(MODEL), "suffix", batch_invariant=True, overlap_scheduling=overlap)
    drafter = engine.scheduler.drafter
    assert drafter.accepted_tokens >= 50, "drafts should be accepted, or nothing was compared"
    assert drafter.accepted_tokens < drafter.proposed_tokens, "some drafts should be rejected too"
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to preempt"
    assert engine.loop.counters.steps < plain_engine.loop.counters.steps
    assert engine.loop.counters.verification_draws > 0, "penalties, n-grams and grammars draw round by round"
    # Overlapped, the steps that drafted (or may) waited for the step before; a plain run never does.
    assert plain_engine.loop.counters.overlap_lost_steps == 0
    assert (engine.loop.counters.overlap_lost_steps > 0) is overlap
    assert sorted(setting for setting, taken in engine.accepted_by_setting.items() if taken) == list(
        range(len(samplings()))
    ), "every setting (penalties, bans, logit_bias, a grammar, greedy) should have drafts accepted"
    for round_index in range(2):
        assert drafted[round_index].keys() == plain[round_index].keys()
        for key, expected in plain[round_index].items():
            assert drafted[round_index][key] == expected, key
    plain_engine.close()
    engine.close()


def test_samples_whose_draws_read_no_tokens_verify_without_a_device_round_per_position(every_draft):
    """GRPO's settings (temperature, top_k, top_p, a seed), with logit_bias, top log-probs and bans by position only
    (begin_suppress_tokens, suppress_tokens, min_new_tokens): every draft position is drawn with its step
    (`verify.sample_drafted`), so no verification round draws on the device, and the tokens, log-probs and top log-probs
    equal plain decoding's bit for bit."""
    prompts = make_prompts(3, 4, 10, seed=17)
    common = dict(temperature=1.0, stop_token_ids=[EOS])
    settings = [
        SamplingParams(**common, top_k=40, top_p=0.95, seed=7),
        SamplingParams(**common, seed=8, logit_bias={7: 2.0}, top_logprobs=3),
        SamplingParams(**common, seed=9, min_new_tokens=20, begin_suppress_tokens=[5], suppress_tokens=[6]),
    ]

    def run(speculative):
        config = dict(num_blocks=160, block_size=4, batch_invariant=True, speculative_disable_by_batch_size=32)
        engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(**config, speculative=speculative))
        for index, (prompt, sampling) in enumerate(zip(prompts, settings)):
            engine.add_request(f"g{index}", prompt, sampling, n=4, max_new_tokens=40)
        outputs = run_to_completion(engine)
        engine.close()
        results = {key: (out.generated_tokens, out.logprobs, out.top_logprobs) for key, out in outputs.items()}
        return results, engine

    (plain, _), (drafted, engine) = run(None), run("suffix")
    assert engine.scheduler.drafter.accepted_tokens >= 30, "drafts should be accepted, or nothing was compared"
    assert engine.loop.counters.verification_draws == 0
    assert drafted == plain


def test_lora_adapters_give_the_same_tokens_and_logprobs_with_drafts(every_draft):
    """Samples of two adapters and of the base model side by side (unmerged adapters, batch_invariant): drafted and
    verified, they equal the plain engine's bit for bit."""
    from test_lora import peft_model

    from rollout.engine.lora.adapter_weights import from_peft_model

    base, model = peft_model()
    prompts = make_prompts(3, 5, 9, seed=21)

    def run(speculative):
        engine = Engine(copy.deepcopy(base), ContinuousBatchingConfig(num_blocks=256, block_size=4,
                        batch_invariant=True, speculative=speculative))  # fmt: skip
        for name in ("policy", "other"):
            engine.load_adapter(name, from_peft_model(model, name))
        for index, (prompt, adapter) in enumerate(zip(prompts, ("policy", "other", None))):
            sampling = SamplingParams(temperature=0.0, stop_token_ids=[])
            engine.add_request(f"g{index}", prompt, sampling, n=2, max_new_tokens=40, adapter=adapter)
        outputs = run_to_completion(engine)
        accepted = engine.scheduler.drafter.accepted_tokens if speculative else 0
        engine.close()
        return {key: (list(out.generated_tokens), list(out.logprobs)) for key, out in outputs.items()}, accepted

    (plain, _), (drafted, accepted) = run(None), run("suffix")
    assert accepted > 0
    assert drafted == plain


@needs_triton_interpreter
def test_drafted_steps_on_the_triton_kernels_give_the_same_tokens(every_draft):
    """On the Triton attention kernels (a GPU's path; on CPU in Triton's interpreter) drafted decodes are chunks of
    several queries: greedy tokens equal the plain engine's on the same kernels, log-probs within rounding."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts = make_prompts(2, 6, 10, seed=13)

    def run(speculative):
        config = dict(num_blocks=64, block_size=16, attention_backend="triton", speculative=speculative)
        engine = Engine(copy.deepcopy(MODEL).to(device), ContinuousBatchingConfig(**config))
        for index, prompt in enumerate(prompts):
            engine.add_request(f"t{index}", prompt, SamplingParams(temperature=0.0, stop_token_ids=[]), n=2,
                               max_new_tokens=16)  # fmt: skip
        outputs = run_to_completion(engine)
        accepted = engine.scheduler.drafter.accepted_tokens if speculative else 0
        engine.close()
        return {key: (list(out.generated_tokens), out.logprobs) for key, out in outputs.items()}, accepted

    (plain, _), (drafted, accepted) = run(None), run("suffix")
    assert accepted > 0
    for key, (tokens, logprobs) in plain.items():
        assert drafted[key][0] == tokens, key
        assert max(abs(a - b) for a, b in zip(drafted[key][1], logprobs)) < 1e-4


def test_logprobs_match_a_teacher_forced_forward(every_draft):
    """Without batch_invariant the verification's multi-token forward rounds differently from a one-token decode:
    its log-probs stay as close to the teacher-forced forward as plain decoding's."""
    model = copy.deepcopy(MODEL)
    results, engine = run_rounds(model, "suffix")
    assert engine.scheduler.drafter.accepted_tokens > 0
    engine.close()
    prompts = make_prompts(len(samplings()), 4, 10, seed=11)
    worst = 0.0
    with torch.no_grad():
        for key, (tokens, logprobs, _, _) in results[1].items():
            prompt = prompts[int(key.split("#")[0][3:])]
            if not tokens:
                continue
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            sampling = samplings()[int(key.split("#")[0][3:])]
            scale = sampling.temperature if sampling.temperature else 1.0
            if sampling.logprob_mode != "temperature_scaled" or sampling.logit_bias or sampling.regex:
                continue  # processed modes include masks and penalties the forward does not know about
            reference = torch.log_softmax(logits / scale, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            worst = max(worst, float((torch.tensor(logprobs) - reference).abs().max()))
    assert worst < 1e-4


def test_rejected_drafts_never_reach_the_prefix_cache(every_draft):
    """A prompt that is an earlier sample's prompt and completion finds its blocks cached, and what it samples on them
    has the log-probs of a teacher-forced forward: no cached block held a rejected draft's KV."""
    model = copy.deepcopy(MODEL)
    engine = Engine(
        model,
        ContinuousBatchingConfig(num_blocks=200, block_size=4, max_batch_tokens=64, speculative="suffix"),
    )
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    sampling = SamplingParams(temperature=1.0, seed=3, stop_token_ids=[])
    engine.add_request("a", prompt, sampling, n=4, max_new_tokens=40)
    outputs = run_to_completion(engine)
    assert engine.scheduler.drafter.proposed_tokens > engine.scheduler.drafter.accepted_tokens > 0
    worst = 0.0
    for index in range(4):
        full = prompt + list(outputs[f"a#{index}"].generated_tokens)
        hits = engine.block_manager.num_prefix_tokens_hit
        engine.add_request(
            f"b{index}", full, SamplingParams(temperature=1.0, seed=5, stop_token_ids=[]), max_new_tokens=3
        )
        (continued,) = run_to_completion(engine).values()
        assert engine.block_manager.num_prefix_tokens_hit - hits >= 44  # every full block of the 49 tokens
        tokens = list(continued.generated_tokens)
        with torch.no_grad():
            logits = model(torch.tensor([full + tokens])).logits[0, len(full) - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(continued.logprobs) - reference).abs().max()))
    engine.close()
    assert worst < 1e-4


def test_streamed_deltas_add_up_to_the_whole_output(every_draft):
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=200, block_size=4, speculative="suffix"))
    prompt = make_prompts(1, 6, 6, seed=2)[0]
    engine.add_request(
        "s", prompt, SamplingParams(temperature=1.0, seed=9, stop_token_ids=[]), n=3, max_new_tokens=40, streaming=True
    )
    pieces: dict[str, list[int]] = {}
    final = {}
    while engine.has_unfinished():
        for output in engine.step():
            pieces.setdefault(output.request_id, []).extend(output.generated_tokens)
            if output.is_finished:
                final[output.request_id] = output
    assert engine.scheduler.drafter.accepted_tokens > 0
    engine.close()
    assert all(len(tokens) == 40 for tokens in pieces.values()) and len(pieces) == 3


def test_a_failing_verification_ends_its_groups_and_the_engine_serves_on(every_draft, monkeypatch):
    """A verification round that raises (a device error) after an earlier round ended a sample: that sample keeps
    its output, the other drafted samples end with the error, every group completes, nothing stays held, and the
    engine serves the next request."""
    from rollout.engine import step_loop

    accept, fired = step_loop.accept_drafts, []

    def failing_later(batch, logits, draw, drafter, progressed, **ahead):
        def draw_or_fail(round_batch, rows):
            if not fired and any(seq.draft and seq.request.is_finished for seq in batch.sequences):
                fired.append(True)
                raise RuntimeError("the device fell over")
            return draw(round_batch, rows)

        accept(batch, logits, draw_or_fail, drafter, progressed, **ahead)

    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=256, block_size=4, speculative="suffix"))
    prompt = make_prompts(1, 6, 6, seed=2)[0]
    greedy = SamplingParams(temperature=0.0, stop_token_ids=[])
    engine.add_request("earlier", prompt, greedy, n=2, max_new_tokens=40)  # drafts for the groups below
    run_to_completion(engine)
    monkeypatch.setattr(step_loop, "accept_drafts", failing_later)
    for index in range(4):
        engine.add_request(f"g{index}", prompt, greedy, max_new_tokens=10 + index)
    outputs = run_to_completion(engine)
    assert fired and sorted(outputs) == ["g0", "g1", "g2", "g3"]
    reasons = sorted(output.finish_reason for output in outputs.values())
    assert "length" in reasons and "error" in reasons
    assert all("the device fell over" in output.error for output in outputs.values() if output.finish_reason == "error")
    assert not engine.loop.open_groups and engine.sampler.slots.num_live == 0
    monkeypatch.setattr(step_loop, "accept_drafts", accept)
    engine.add_request("after", prompt, greedy, max_new_tokens=8)
    (after,) = run_to_completion(engine).values()
    assert after.finish_reason == "length" and len(after.generated_tokens) == 8
    engine.close()


def test_a_draft_that_poisons_its_step_is_withdrawn_not_an_error(every_draft):
    """A draft token whose KV is non-finite (its embedding NaN: an overflow on one input) turns the drafted step's
    other positions NaN through masked attention. Plain decoding never feeds that token to the sample, so the sample
    is recomputed without drafts instead of ended: the same tokens as plain decoding, and the engine holds nothing
    afterwards."""
    prompt = make_prompts(1, 6, 6, seed=2)[0]
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=256, block_size=16))
    engine.add_request("ref", prompt, SamplingParams(temperature=0.0, stop_token_ids=[]), max_new_tokens=40)
    reference = list(run_to_completion(engine)["ref"].generated_tokens)
    engine.close()
    poison, before = reference[14], reference[13]

    def run(speculative):
        model = copy.deepcopy(MODEL)
        with torch.no_grad():
            model.get_input_embeddings().weight[poison] = float("nan")
        config = ContinuousBatchingConfig(num_blocks=256, block_size=16, batch_invariant=True, speculative=speculative)
        engine = Engine(model, config)
        # S stops at the poison token (sampled, never fed); T is biased away from the token before it: T never
        # samples the poison token, but its drafts (from S) hold it.
        engine.add_request("S", prompt, SamplingParams(temperature=0.0, stop_token_ids=[poison]), max_new_tokens=40)
        run_to_completion(engine)
        biased = SamplingParams(temperature=0.0, stop_token_ids=[], logit_bias={before: -100.0})
        engine.add_request("T", prompt, biased, max_new_tokens=40)
        output = run_to_completion(engine)["T"]
        drafts = engine.scheduler.drafter.proposed_tokens if speculative else 0
        engine.close()
        return output, drafts

    (plain, _), (drafted, drafts) = run(None), run("suffix")
    assert drafts > 0 and plain.finish_reason == drafted.finish_reason == "length"
    assert list(drafted.generated_tokens) == list(plain.generated_tokens)
    assert drafted.logprobs == plain.logprobs


def test_a_sample_withdrawn_by_a_verification_round_draws_no_further_round():
    """A round whose logits turn non-finite sends its sample back to be recomputed (WAITING, no KV): the rounds after
    it must not draw for it, even where its next draft token equals its last token (a run of one token)."""
    from types import SimpleNamespace

    from rollout.engine.requests.request import RequestStatus
    from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
    from rollout.engine.speculative.verify import accept_drafts

    request = make_request("r", [5, 6, 7], max_new_tokens=8)
    request.status, request.num_computed_tokens = RequestStatus.RUNNING, 3
    draft = (9, 9, 9)
    batch = ScheduledBatch(sequences=[ScheduledSequence(request, 2, 4, draft)], logits_sequences=[0])
    batch.samples.append((request, 0))
    request.token_ids.append(9)  # the step's own draw (its row 0) equalled the first draft token
    rounds = []

    def draw(round_batch, logits):
        rounds.append(round_batch.sequences[0].start)
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0  # withdrawn: recomputed later
        return []

    accept_drafts(batch, torch.zeros(4, 2), draw, SimpleNamespace(verified=lambda *args: None), [])
    assert rounds == [3]


def test_one_sampling_pass_splits_into_first_draws_and_draws_ahead_with_their_faults():
    """A drafted step samples its first draws and its draws ahead in one pass (`verify.sample_drafted`): the first
    rows read as the step's own samples, the others row by row for the verification rounds, each part with its own
    rows' faults renumbered (a dead or non-finite row elsewhere is not theirs)."""
    from rollout.engine.sampling.pending_samples import PendingSamples, row_faults

    tokens = torch.tensor([5, 6, 7, 8])
    chosen = torch.tensor([-0.5, -0.25, -1.0, -2.0])
    faults = row_faults(torch.tensor([False, False, True, False]), torch.tensor([False, True, False, False]))
    both = PendingSamples(tokens, [tokens, chosen], None, faults)
    head = both.first_rows(2).fetch()
    assert (head.token_ids, head.logprobs, head.dead_rows, head.broken_rows) == ([5, 6], [-0.5, -0.25], [1], [])
    assert both.first_rows(2).token_ids.tolist() == [5, 6]
    ahead = both.select([3, 2])
    assert (ahead.token_ids, ahead.logprobs, ahead.dead_rows, ahead.broken_rows) == ([8, 7], [-2.0, -1.0], [], [1])


def test_the_warm_up_leaves_no_drafts():
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=64, speculative="suffix"))
    engine.warmup()
    assert engine.scheduler.drafter.num_pools == 0
    engine.close()


def test_drafts_only_in_a_thin_batch():
    engine = Engine(
        copy.deepcopy(MODEL),
        ContinuousBatchingConfig(
            num_blocks=400, block_size=4, speculative="suffix", speculative_disable_by_batch_size=2
        ),
    )
    engine.add_request(
        "wide", make_prompts(1, 6, 6, seed=2)[0], SamplingParams(seed=1, stop_token_ids=[]), n=8, max_new_tokens=30
    )
    run_to_completion(engine)
    assert engine.scheduler.drafter.proposed_tokens == 0
    engine.close()


def test_pools_are_per_scope_and_adapter_and_bounded():
    pool = DraftPool(prompt_length=3)
    first = pool.add([1, 2, 3, 4, 5, 6, 7, 8])
    second = pool.add([1, 2, 3, 4, 5])
    pool.catch_up()
    assert pool.propose(second, 2) == ((6, 7), 5)  # the longest match's continuation
    assert pool.propose(first, 3) == ((), 0)  # nothing follows its own end elsewhere
    third = pool.add([1, 2, 3, 9, 5, 6, -1])  # a placeholder at the end is not a token
    pool.catch_up()
    assert pool.propose(third, 4) == ((7, 8), 2)


def drafting(request_tokens: list[int], **sampling) -> tuple[SuffixDrafter, object]:
    """A drafter that knows one finished sample ([1..8] after prompt [1, 2, 3]) and a running sample of the same
    prompt at `request_tokens`, whose drafts it is asked for."""
    drafter = SuffixDrafter(num_speculative_tokens=4, disable_by_batch_size=8, index_tokens=1000)
    drafter._rates = {length: [1.0, 1.0] for length in drafter._rates}  # every match length pays already
    earlier = make_request("earlier", [1, 2, 3])
    earlier.token_ids += [4, 5, 6, 7, 8]
    drafter.finished(earlier)
    running = make_request("running", [1, 2, 3], max_new_tokens=20, **sampling)
    running.token_ids += request_tokens
    drafter.speculates(1)
    return drafter, running


def test_a_sample_whose_drafts_keep_failing_pauses_four_steps_after_two_rejected_in_a_row():
    """Two drafts rejected whole in a row pause a sample 4 steps, however often it failed before; a draft accepted
    whole between two rejected ones keeps it drafting."""
    drafter = SuffixDrafter(num_speculative_tokens=4, disable_by_batch_size=8, index_tokens=1000)
    request = make_request("r", [1, 2, 3], max_new_tokens=200)
    request.token_ids += [4, 5]
    drafter._row(request)  # joins its pool
    row, verified_at, pauses = request.draft_row, [], []
    for _ in range(100):
        drafter.speculates(1)
        if drafter._step >= row.resume_step:  # not paused: its draft is verified, all of it rejected
            verified_at.append(drafter._step)
            drafter.verified(request, proposed=4, accepted=0)
            if row.resume_step > drafter._step:
                pauses.append(row.resume_step - drafter._step)
    assert set(pauses) == {4} and len(pauses) == len(verified_at) // 2
    assert verified_at[:6] == [1, 2, 6, 7, 11, 12]  # two tries, a pause of 4 steps, two tries, ...
    drafter._step = row.resume_step
    drafter.verified(request, proposed=4, accepted=0)  # back from a pause: one rejected ...
    drafter.verified(request, proposed=4, accepted=4)  # ... one accepted whole ...
    drafter.verified(request, proposed=4, accepted=0)  # ... and one rejected: still drafting
    assert row.resume_step <= drafter._step


def test_a_tail_whose_every_sample_pauses_keeps_its_steps_overlapped():
    """With overlapped scheduling, the step loop waits for a step's tokens before the next thin step only when that
    step may draft: not while every running sample pauses, nor when no match length pays."""
    drafter = SuffixDrafter(num_speculative_tokens=4, disable_by_batch_size=8, index_tokens=1000)
    drafter._rates = {length: [1.0, 1.0] for length in drafter._rates}  # every match length pays
    first, second = (make_request(name, [1, 2, 3], max_new_tokens=200) for name in ("a", "b"))
    for request in (first, second):
        request.token_ids += [4, 5]
        drafter._row(request)
    assert drafter.wants_tokens([first, second])
    drafter.speculates(2)
    for _ in range(2):  # two drafts rejected whole in a row: the first sample pauses 4 steps
        drafter.verified(first, proposed=4, accepted=0)
    assert drafter.wants_tokens([first, second]) and not drafter.wants_tokens([first])
    for _ in range(2):
        drafter.speculates(1)
    assert not drafter.wants_tokens([first])  # the next step is its pause's last
    drafter.speculates(1)
    assert drafter.wants_tokens([first])  # it may draft at the next one
    drafter._rates = {length: [0.0, 1.0] for length in drafter._rates}  # no match length pays (and no exploring)
    assert not drafter.wants_tokens([first, second])


@pytest.mark.parametrize(("length", "accepted", "pays"), [(4, 4, True), (8, 8, True), (1, 1, False), (4, 0, False)])
def test_a_match_length_proposes_once_an_explorations_draft_of_four_was_accepted(length, accepted, pays):
    """A match length starts just short of paying: one draft of 4 tokens or more accepted whole makes it propose;
    a shorter one weighs too little alone, and a rejected one never does."""
    drafter = SuffixDrafter(num_speculative_tokens=8, disable_by_batch_size=8, index_tokens=1000)
    assert not drafter._pays(2)
    request = make_request("r", [1, 2, 3], max_new_tokens=20)
    request.token_ids += [4, 5]
    drafter._row(request).match = 2  # its draft followed a match of 2 tokens
    drafter.verified(request, proposed=length, accepted=accepted)
    assert drafter._pays(2) is pays and not drafter._pays(3)


def test_drafts_continue_an_earlier_sample_and_stop_before_a_ban():
    drafter, running = drafting([4, 5])
    assert drafter.propose(running, 4) == (6, 7, 8)
    drafter, running = drafting([4, 5], suppress_tokens=[7])
    assert drafter.propose(running, 4) == (6,)
    drafter, running = drafting([4, 5], stop_token_ids=(7,), min_new_tokens=10)  # a stop token before min_new_tokens
    assert drafter.propose(running, 4) == (6,)
    drafter, running = drafting([4, 5], stop_token_ids=(7,), min_new_tokens=3)  # 7 would be the 4th: allowed
    assert drafter.propose(running, 4) == (6, 7, 8)


def test_drafts_stop_before_a_token_the_grammar_refuses():
    a, b, c = TOKENIZER.convert_tokens_to_ids(["a", "b", "c"])
    engine = Engine(tiny_model(0), ContinuousBatchingConfig(num_blocks=64), tokenizer=TOKENIZER)
    drafter, running = drafting([a, b], regex="(ab)+")
    earlier = make_request("earlier ab", [1, 2, 3])
    earlier.token_ids += [a, b, a, b, c]
    drafter.finished(earlier)
    running.constraint = engine.intake.constraint(running.sampling)
    for token in (a, b):
        running.constraint.accept(token)
    assert drafter.propose(running, 4) == (a, b)  # "c" breaks (ab)+
    assert running.constraint.matcher.accept_token(a)  # the matcher was left where it was (after "ab")
    engine.close()


def test_drafts_are_shared_within_one_scope_and_adapter_only():
    drafter, running = drafting([4, 5])
    running.client = "another client"
    assert drafter.propose(running, 4) == ()
    assert drafter.num_pools == 2


def test_the_kept_samples_stay_within_the_memory_bound():
    drafter = SuffixDrafter(num_speculative_tokens=4, disable_by_batch_size=8, index_tokens=25)
    for index in range(5):
        sample = make_request(f"s{index}", [index, 1, 2])
        sample.token_ids += [3, 4, 5, 6, 7]
        drafter.finished(sample)  # 8 tokens each: three prompts fit in 25
    assert drafter.num_pools == 3


def test_a_request_that_generated_nothing_keeps_no_pool():
    """A score-only request (max_new_tokens=0: prompt log-probs only) has no sample to draft from: its long prompt
    must not push a prompt's finished samples out of the memory bound."""
    engine = Engine(copy.deepcopy(MODEL), ContinuousBatchingConfig(num_blocks=128, block_size=4, speculative="suffix",
                    speculative_index_tokens=100), tokenizer=TOKENIZER)  # fmt: skip
    prompt, scored = make_prompts(2, 8, 8, seed=1)
    engine.add_request("g", prompt, SamplingParams(temperature=1.0, seed=0, stop_token_ids=[]), n=2, max_new_tokens=20)
    run_to_completion(engine)
    engine.add_request("scored", scored * 8, SamplingParams(prompt_logprobs=0), max_new_tokens=0)
    assert len(run_to_completion(engine)["scored"].prompt_logprobs) == 64
    pools = [key[-1] for key in engine.scheduler.drafter._pools]
    engine.close()
    assert pools == [tuple(prompt)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("speculative", "eagle"),
        ("num_speculative_tokens", 0),
        ("num_speculative_tokens", 65),
        ("speculative_disable_by_batch_size", -1),
        ("speculative_index_tokens", 1.5),
        ("speculative_clear_on_weight_update", "yes"),
    ],
)
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(FieldError, match=field):
        ContinuousBatchingConfig(**{field: value})

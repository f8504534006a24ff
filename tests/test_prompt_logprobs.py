"""Prompt log-probs (`SamplingParams.prompt_logprobs`, vLLM's): every prompt position's log-prob and top-k, computed
in the prefill forward, against a teacher-forced transformers forward (model(ids).logits, fp32 log_softmax, gather)
on models whose head is scaled to a realistic entropy (a random model's near-uniform logits would hide a mismatch)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import (
    MODEL_CONFIGS,
    VOCAB,
    make_engine,
    make_prompts,
    needs_triton_interpreter,
    reference_copy,
    run_to_completion,
    tiny_model,
)
from rollout.benchmarks.throughput.fidelity import fidelity_against_floor, mean_entropy, scale_to_entropy
from rollout.config import FieldError, SamplingParams
from rollout.engine.runner import model_runner
from rollout.engine.sampling import prompt_logprobs
from rollout.engine.sampling.fp32_head import fp32_projection

FP32_TOLERANCE = 1e-5
# bf16: a position may be off by about one spacing of its bf16 logits (1/16 between 8 and 16, 1/8 up to 32).
BF16_MAX = 0.15


def scaled_model(kind: str = "qwen3", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model whose mean next-token entropy is ~1.5 nats (fidelity.scale_to_entropy), in `dtype`."""
    model = tiny_model(kind)
    scale_to_entropy(model, make_prompts(4, 30, 60, seed=11))
    return model.to(dtype)


def teacher_forced(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab) fp32 log-probs of positions 1.. from one ordinary forward over the prompt."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def check(output, reference: torch.nn.Module, prompt: list[int], k: int, tolerance: float, exact_ids: bool = True):
    """The output's prompt log-probs and top-k equal the teacher-forced ones; returns the largest |difference|."""
    expected = teacher_forced(reference, prompt)
    assert len(output.prompt_logprobs) == len(output.prompt_top_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None and output.prompt_top_logprobs[0] is None
    chosen = expected.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))[:, 0]
    worst = float((torch.tensor(output.prompt_logprobs[1:]) - chosen).abs().max())
    if exact_ids:  # vLLM's rank: 1 + the tokens strictly more likely than the prompt's own
        ranks = (expected > chosen.unsqueeze(1)).sum(-1) + 1
        assert output.prompt_logprob_ranks == [None, *ranks.tolist()]
    top_values, top_ids = expected.topk(k, -1) if k else (None, None)
    for position, pairs in enumerate(output.prompt_top_logprobs[1:]):
        assert len(pairs) == k, position
        if not k:
            continue
        ids = [token for token, _ in pairs]
        values = torch.tensor([value for _, value in pairs])
        if exact_ids:
            assert ids == top_ids[position].tolist(), position
        else:  # bf16 logits tie often: each returned token's own log-prob must match, and the values the top-k's
            worst = max(worst, float((values - expected[position, ids]).abs().max()))
        worst = max(worst, float((values - top_values[position]).abs().max()))
    assert worst <= tolerance, worst
    return worst


def score(engine, group_id: str, prompt: list[int], k: int, **kwargs):
    """Run one request with prompt log-probs to completion; its final output."""
    max_new_tokens = kwargs.pop("max_new_tokens", 2)
    sampling = SamplingParams(prompt_logprobs=k, do_sample=False, stop_token_ids=(), **kwargs)
    engine.add_request(group_id, prompt, sampling, max_new_tokens=max_new_tokens)
    return run_to_completion(engine)[group_id]


@pytest.fixture(scope="module")
def qwen3():
    model = scaled_model("qwen3")
    assert 1.3 < mean_entropy(model, make_prompts(2, 30, 60, seed=12)) < 1.7
    return model


@pytest.mark.parametrize("overlap", [False, True])
def test_matches_teacher_forced_across_chunks_and_the_prefix_cache(qwen3, overlap):
    """A prompt six times the step's token budget arrives over several chunks; the same prompt again, whose blocks
    are then in the prefix cache, still gets every position (it takes no cached block, while a plain request does);
    and a prompt sharing a long prefix with it too."""
    reference = reference_copy(qwen3)
    engine = make_engine(qwen3, block_size=4, max_batch_tokens=16, overlap_scheduling=overlap)
    prompt = make_prompts(1, 97, 97, seed=5)[0]
    check(score(engine, "first", prompt, 5), reference, prompt, 5, FP32_TOLERANCE)
    hits = engine.block_manager.num_prefix_tokens_hit
    check(score(engine, "again", prompt, 3), reference, prompt, 3, FP32_TOLERANCE)
    assert engine.block_manager.num_prefix_tokens_hit == hits  # recomputed, not taken from the cache
    sibling = prompt[:80] + make_prompts(1, 9, 9, seed=6)[0]
    check(score(engine, "sibling", sibling, 0), reference, sibling, 0, FP32_TOLERANCE)
    assert engine.block_manager.num_prefix_tokens_hit == hits
    engine.add_request("plain", prompt, SamplingParams(do_sample=False), max_new_tokens=1)
    assert run_to_completion(engine)["plain"].prompt_logprobs is None
    assert engine.block_manager.num_prefix_tokens_hit > hits  # the prefix was cached all along
    engine.block_manager.check_all_free()


def test_softcapped_model_and_an_unreproduced_head_is_refused():
    """Gemma 2 soft-caps its logits after the head: the scores apply it too. A head the scorer does not reproduce
    (here: the soft-capping forgotten) ends the request with an error naming prompt_logprobs, never wrong values,
    and later ones are refused by name."""
    model = scaled_model("gemma2")
    reference = reference_copy(model)
    prompt = make_prompts(1, 40, 40, seed=7)[0]
    engine = make_engine(model, max_batch_tokens=16)
    check(score(engine, "capped", prompt, 2), reference, prompt, 2, FP32_TOLERANCE)
    broken = make_engine(model, max_batch_tokens=16)
    broken.runner.prompt_scorer.softcap = None
    output = score(broken, "uncapped", prompt, 2)
    assert output.finish_reason == "error" and "prompt_logprobs" in output.error
    assert output.prompt_logprobs is None
    with pytest.raises(FieldError, match="prompt_logprobs"):  # known now: refused when submitted
        broken.add_request("later", prompt, SamplingParams(prompt_logprobs=0))
    broken.add_request("plain", prompt, SamplingParams(do_sample=False), max_new_tokens=2)
    assert run_to_completion(broken)["plain"].finish_reason == "length"  # everything else is served as before


@pytest.mark.parametrize("fp32_logits", [False, True])
def test_bf16_matches_a_bf16_teacher_forced_forward(fp32_logits):
    """bf16 model (with fp32_logits: the head in fp32 on both sides, as TRL's cast_lm_head_to_fp32), chunked or not.
    bf16 logits of magnitude 8-16 are 1/16 apart, so a position may differ by about 0.1 however it is computed: the
    bound is the trainer's own floor (fidelity.py: its left-padded batch forward against its one-sequence forward,
    over the prompts' second halves), which ours must not exceed in mean by much, and BF16_MAX at any position."""
    model = scaled_model("qwen3", torch.bfloat16)
    reference = reference_copy(model)
    if fp32_logits:
        reference.get_output_embeddings().register_forward_hook(fp32_projection)
    prompts = make_prompts(3, 40, 80, seed=8)
    cuts = [len(prompt) // 2 for prompt in prompts]  # different lengths: the padded batch pads them
    for budget in (24, 512):  # chunked prefill; each prompt in one chunk
        engine = make_engine(model, max_batch_tokens=budget, fp32_logits=fp32_logits)
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, SamplingParams(prompt_logprobs=4), max_new_tokens=0)
        finished = run_to_completion(engine)
        outputs = [finished[str(index)] for index in range(len(prompts))]
        worst = max(
            check(out, reference, prompt, 4, BF16_MAX, exact_ids=False) for out, prompt in zip(outputs, prompts)
        )
        halves = fidelity_against_floor(
            model=reference,
            prompts=[prompt[:cut] for prompt, cut in zip(prompts, cuts)],
            completions=[prompt[cut:] for prompt, cut in zip(prompts, cuts)],
            logprobs=[output.prompt_logprobs[cut:] for output, cut in zip(outputs, cuts)],
            fp32_head=False,  # the reference carries its own fp32 head hook already
        )
        ours, floor = halves["rollout"], halves["floor"]
        print(
            f"bf16, fp32_logits={fp32_logits}, max_batch_tokens={budget}: max |delta| {worst:.3g} over every "
            f"position and top-k; second halves: mean {ours['mean']:.3g} max {ours['max']:.3g}, trainer's floor mean "
            f"{floor['mean']:.3g} max {floor['max']:.3g}"
        )
        assert ours["mean"] <= 1.5 * floor["mean"] + 1e-3 and ours["max"] <= BF16_MAX


def test_peak_logits_are_bounded_by_the_slice(monkeypatch):
    """A 4k-token prompt in one chunk: the output head never sees more than the slice's rows at once (the model's
    own call makes only the sampled row), and every position is scored exactly once."""
    config = MODEL_CONFIGS["qwen3"]()
    config.max_position_embeddings = 4200
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = reference_copy(model)
    rows_per_slice = 64
    monkeypatch.setattr(prompt_logprobs, "MAX_SLICE_ELEMENTS", rows_per_slice * VOCAB)
    prompt = make_prompts(1, 4096, 4096, seed=9)[0]
    engine = make_engine(model, block_size=16, num_blocks=260, max_batch_tokens=4096)
    calls: list[int] = []  # from here: the engine's build runs one probe forward of its own (attention_probe.py)
    model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: calls.append(output.shape[:-1].numel())
    )
    output = score(engine, "long", prompt, 1, max_new_tokens=0)
    assert max(calls) <= rows_per_slice, max(calls)
    # Every position once, plus the sampled row twice: the model's own head call and the scorer's one-time check.
    assert sum(calls) == (len(prompt) - 1) + 2
    check(output, reference, prompt, 1, FP32_TOLERANCE)


def test_score_only_returns_no_tokens_and_streams_once(qwen3):
    """max_new_tokens 0 (only with prompt_logprobs): finish_reason "length", no tokens, every prompt log-prob; a
    streaming one delivers a single output. Streaming with tokens: only the first delta carries them."""
    reference = reference_copy(qwen3)
    prompt = make_prompts(1, 30, 30, seed=10)[0]
    engine = make_engine(qwen3, max_batch_tokens=8)
    output = score(engine, "score", prompt, 2, max_new_tokens=0, top_logprobs=2)
    assert (output.finish_reason, output.generated_tokens, output.logprobs, output.top_logprobs) == (
        "length",
        [],
        [],
        [],
    )
    assert output.policy_versions == []
    check(output, reference, prompt, 2, FP32_TOLERANCE)
    for max_new_tokens, expected_outputs in ((0, 1), (3, 3)):
        engine.add_request(
            "s", prompt, SamplingParams(prompt_logprobs=1), max_new_tokens=max_new_tokens, streaming=True
        )
        deltas = []
        while engine.has_unfinished():
            deltas += engine.step()
        assert len(deltas) == expected_outputs and deltas[-1].is_finished
        check(deltas[0], reference, prompt, 1, FP32_TOLERANCE)
        assert all(delta.prompt_logprobs is None for delta in deltas[1:])
        assert sum(len(delta.generated_tokens) for delta in deltas) == max_new_tokens
    engine.block_manager.check_all_free()


def test_validation_names_the_field():
    with pytest.raises(FieldError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(FieldError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
    with pytest.raises(FieldError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(prompt_logprobs=0, max_new_tokens=0).changed_fields() == {
        "prompt_logprobs": 0,
        "max_new_tokens": 0,
    }
    assert SamplingParams.from_fields({"prompt_logprobs": 3}).prompt_logprobs == 3
    engine = make_engine(tiny_model("qwen3"))
    with pytest.raises(FieldError, match="max_new_tokens"):
        engine.add_request("r", [1, 2], SamplingParams(), max_new_tokens=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_groups_and_preemption_score_each_prompt_once(qwen3, monkeypatch, overlap, unknown_lengths):
    """Groups of n = 2 in a cache too small for them all, with a small token budget: samples are preempted and
    recomputed, some in the middle of their prompt. Each prompt is scored once (its leader's forward, shared by its
    forked sample), no position is lost or repeated, and every sample's values equal the teacher-forced ones."""
    reference = reference_copy(qwen3)
    planned: list[int] = []
    plan = model_runner.plan_prompt_rows
    monkeypatch.setattr(model_runner, "plan_prompt_rows", lambda batch: record(plan(batch), planned))
    partial: list[str] = []
    engine = make_engine(qwen3, num_blocks=24, block_size=4, max_batch_tokens=8, overlap_scheduling=overlap)
    reset = engine.scheduler.reset_for_recompute

    def reset_and_note(request):
        if request.wants_prompt_logprobs and len(request.prompt_logprobs) > 1:  # scored in part: recomputed
            partial.append(request.request_id)
        reset(request)

    monkeypatch.setattr(engine.scheduler, "reset_for_recompute", reset_and_note)
    prompts = make_prompts(8, 20, 50, seed=4)
    for index, prompt in enumerate(prompts):
        sampling = SamplingParams(prompt_logprobs=2, seed=index, stop_token_ids=())
        engine.add_request(str(index), prompt, sampling, n=2, max_new_tokens=20)
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0 and partial, (engine.scheduler.num_preemptions, partial)
    assert sum(planned) == sum(len(prompt) - 1 for prompt in prompts)
    for index, prompt in enumerate(prompts):
        for sample in range(2):
            output = outputs[f"{index}#{sample}"]
            assert len(output.generated_tokens) == 20
            check(output, reference, prompt, 2, FP32_TOLERANCE)
    engine.block_manager.check_all_free()


def record(plan, planned: list[int]):
    if plan is not None:
        planned.append(len(plan.rows))
    return plan


@needs_triton_interpreter
def test_decode_graphs_serve_the_decodes_around_scoring_steps(qwen3):
    """With decode graphs (persistent buffers; captured on CUDA, eager on CPU), a scoring request's prefill steps run
    eagerly while other samples' decode steps keep replaying the graphs, and its scores are unchanged."""
    pytest.importorskip("triton")
    from test_cuda_graphs import graph_engine

    reference = reference_copy(qwen3)
    engine, replays = graph_engine(qwen3, num_blocks=32, max_batch_tokens=8)
    engine.add_request("plain", [3, 1, 4, 1, 5], SamplingParams(do_sample=False), max_new_tokens=6)
    engine.step()
    prompt = make_prompts(1, 20, 20, seed=13)[0]
    check(score(engine, "scored", prompt, 2, max_new_tokens=3), reference, prompt, 2, FP32_TOLERANCE)
    assert replays, "decode steps should have replayed the graphs"
    engine.close()

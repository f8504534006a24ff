"""`ContinuousBatchingConfig(batch_invariant=True)`: rollout's log-probs equal the trainer's own forward under
`trainer_bridge.batch_invariant` (the transformers model class, TRL's padded layout) bit for bit, in fp32 and bf16, on
models scaled to realistic entropy, through chunked prefill, prompt blocks shared within groups and across requests
(prefix-cache hits), and preemption with recompute; the same seed gives the same tokens whatever the batch. The
ordinary engine differs from the same trainer forward (so the comparison can fail)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_batch_invariant import PAIRS, realistic, trl_batch_logprobs
from transformers import CompileConfig

from conftest import make_engine, make_prompts, run_to_completion
from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.invariant import mode as invariant_mode
from trainer_bridge import batch_invariant

# A small cache (preemption), a small token budget (chunked prefill, prefills beside decodes), 4-token blocks.
SMALL = {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 12}


def sample_groups(
    engine, prompts: list[list[int]], prefix: str, n: int = 3
) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Sample a group of `n` per prompt (temperature 1, seeded by the prompt); (prompt, completion, log-probs) of
    every sample."""
    for index, prompt in enumerate(prompts):
        engine.add_request(
            f"{prefix}{index}", prompt, SamplingParams(temperature=1.0, seed=sum(prompt)), n=n, max_new_tokens=20
        )
    outputs = run_to_completion(engine)
    return [(list(o.prompt_ids), list(o.generated_tokens), torch.tensor(o.logprobs)) for o in outputs.values()]


def largest_gap_to_trainer(trainer: torch.nn.Module, samples) -> float:
    """The largest |delta| between rollout's log-probs and the trainer's invariant forward, over batches of 5
    samples in TRL's layout."""
    gap = 0.0
    with torch.no_grad(), batch_invariant(trainer):
        for first in range(0, len(samples), 5):
            chunk = samples[first : first + 5]
            for (_, _, ours), theirs in zip(chunk, trl_batch_logprobs(trainer, [(p, c) for p, c, _ in chunk])):
                assert ours.shape == theirs.shape
                gap = max(gap, float((ours - theirs).abs().max()))
    return gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "qwen3_moe", "llama_wide_mha", "llama_mlp300", "gpt_neox"])
def test_rollout_logprobs_equal_the_trainers_forward_bit_for_bit(kind, dtype):
    model = realistic(kind, dtype)
    trainer = copy.deepcopy(model)
    engine = make_engine(model, batch_invariant=True, **SMALL)
    shared = make_prompts(1, 13, 13, seed=5)[0]  # a prefix the second round finds cached
    first = sample_groups(engine, [shared + tail for tail in make_prompts(3, 2, 20, seed=1)], "a")
    hits = engine.block_manager.num_prefix_tokens_hit
    second = sample_groups(engine, [shared + tail for tail in make_prompts(3, 2, 20, seed=2)], "b")
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    assert engine.block_manager.num_prefix_tokens_hit - hits >= 12, "the second round should find the prefix cached"
    engine.close()
    assert largest_gap_to_trainer(trainer, first + second) == 0.0
    if dtype == torch.bfloat16:
        ordinary = make_engine(copy.deepcopy(trainer), **SMALL)
        assert largest_gap_to_trainer(trainer, sample_groups(ordinary, [shared], "c")) > 1e-3
        ordinary.close()


def test_preemption_by_swapping_out_keeps_every_bit():
    """Preempted sequences swapped to the CPU and back (the cache's heads-first blocks moved whole) still give the
    trainer's bits."""
    model = realistic("qwen3", torch.bfloat16)
    trainer = copy.deepcopy(model)
    engine = make_engine(model, batch_invariant=True, cpu_offload_space=0.01, **SMALL)
    assert engine.kv_cache.heads_first
    samples = sample_groups(engine, make_prompts(3, 2, 20, seed=3), "s")
    assert engine.scheduler.num_swaps > 0, "the cache should be small enough to force swapping"
    engine.close()
    assert largest_gap_to_trainer(trainer, samples) == 0.0


def test_the_same_seed_gives_the_same_tokens_whatever_the_batch():
    model = realistic("qwen3", torch.bfloat16)
    prompt = make_prompts(1, 9, 9, seed=7)[0]
    alone = make_engine(model, batch_invariant=True)
    (expected,) = sample_groups(alone, [prompt], "x", n=1)
    alone.close()
    crowded = make_engine(model, batch_invariant=True, max_batch_tokens=16)
    results = sample_groups(crowded, make_prompts(5, 3, 30, seed=8) + [prompt], "y", n=1)
    crowded.close()
    (same,) = [r for r in results if r[0] == prompt]
    assert same[1] == expected[1] and torch.equal(same[2], expected[2])


@pytest.mark.parametrize(
    "setting, name",
    [
        ({"attention_backend": "triton"}, "attention_backend: .* must not be 'triton' with batch_invariant"),
        ({"decode_compile_config": CompileConfig()}, "decode_compile_config: .* must be None with batch_invariant"),
        ({"batch_invariant": 1}, "batch_invariant"),
    ],
)
def test_settings_the_invariant_mode_cannot_run_with_are_refused_by_name(setting, name):
    with pytest.raises(FieldError, match=name):
        ContinuousBatchingConfig(**{"batch_invariant": True, **setting})


def test_the_worker_flag_turns_it_on():
    from rollout.service.launch.cli import build_parser
    from rollout.service.launch.flags import engine_config

    assert engine_config(build_parser().parse_args(["--batch-invariant"])).batch_invariant is True
    assert engine_config(build_parser().parse_args([])).batch_invariant is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompt_logprobs_equal_the_trainers_forward(dtype):
    """Prompt log-probs (`SamplingParams.prompt_logprobs`), chunked beside other requests, are the trainer's too."""
    model = realistic("qwen3", dtype)
    trainer = copy.deepcopy(model)
    prompt = make_prompts(1, 23, 23, seed=9)[0]
    engine = make_engine(model, batch_invariant=True, max_batch_tokens=8)
    for index, other in enumerate(make_prompts(3, 5, 20, seed=10)):
        engine.add_request(f"o{index}", other, SamplingParams(temperature=1.0, seed=index), max_new_tokens=6)
    engine.add_request("p", prompt, SamplingParams(temperature=1.0, seed=1, prompt_logprobs=0), max_new_tokens=1)
    output = run_to_completion(engine)["p"]
    engine.close()
    ours = torch.tensor(output.prompt_logprobs[1:])
    with torch.no_grad(), batch_invariant(trainer):
        logits = trainer(torch.tensor([prompt])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_block_size_that_does_not_divide_the_key_block_is_bit_for_bit_too(dtype):
    """Blocks of 12 tokens: the gathered keys are not a whole number of the attention's 64-key blocks, and are
    copied into them (with 4-token blocks the table is padded and the keys read where they were gathered)."""
    model = realistic("qwen3", dtype)
    trainer = copy.deepcopy(model)
    engine = make_engine(model, batch_invariant=True, num_blocks=60, block_size=12, max_batch_tokens=10)
    samples = sample_groups(engine, make_prompts(3, 2, 30, seed=1), "a")
    engine.close()
    assert largest_gap_to_trainer(trainer, samples) == 0.0


def trl_fp32_head(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with TRL's `cast_lm_head_to_fp32`: the head's weight in fp32, its forward a functional
    `F.linear` of fp32 hidden states (what `batch_invariant`'s mode computes in its tiles)."""
    trainer = copy.deepcopy(model)
    head = trainer.lm_head.float()
    trainer.lm_head = head
    head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), head.weight.float())
    return trainer


def test_the_fp32_head_is_bit_for_bit_after_forwards_that_did_without_it():
    """`fp32_logits` computes the head in the invariant tiles, as TRL's fp32 head under `batch_invariant`, also once
    the model's forwards were found to need no `InvariantLinearMode` (an invariant engine without the fp32 head ran
    first: its fp32 product ran as a plain `F.linear`, 2e-7 to 3e-2 nats from the trainer's, varying with the batch)."""
    model = realistic("qwen3", torch.bfloat16)
    trainer = trl_fp32_head(model)
    plain = make_engine(model, batch_invariant=True)
    sample_groups(plain, make_prompts(1, 5, 5, seed=3), "p", n=1)
    plain.close()
    engine = make_engine(model, batch_invariant=True, fp32_logits=True, **SMALL)
    samples = sample_groups(engine, make_prompts(3, 2, 20, seed=4), "f")
    engine.close()
    assert largest_gap_to_trainer(trainer, samples) == 0.0


def test_the_trainers_fp32_head_set_after_an_invariant_forward_is_invariant_too(monkeypatch):
    """TRL's `cast_lm_head_to_fp32` gives the head a forward calling `F.linear`, which no swap sees: set after a
    `batch_invariant(model)` forward had found the model's forwards to need no `InvariantLinearMode` (an evaluation
    before the trainer was built), the head ran as a plain product; the need is learnt again for the new forward,
    and the trainer's log-probs equal an `fp32_logits` engine's bit for bit."""
    model = realistic("qwen3", torch.bfloat16)
    trainer = copy.deepcopy(model)
    with torch.no_grad(), batch_invariant(trainer):
        trl_batch_logprobs(trainer, PAIRS[:2])  # learnt: no mode needed
    head = trainer.lm_head.float()
    trainer.lm_head = head
    head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), head.weight.float())  # TRL's cast
    routed = []  # the head's products computed as invariant_linear (this CPU's plain one happens to agree here)
    linear = invariant_mode.invariant_linear
    monkeypatch.setattr(
        invariant_mode, "invariant_linear", lambda x, w, *a: routed.append(w is head.weight) or linear(x, w, *a)
    )
    engine = make_engine(model, batch_invariant=True, fp32_logits=True, **SMALL)
    samples = sample_groups(engine, make_prompts(3, 2, 20, seed=4), "f")
    engine.close()
    assert largest_gap_to_trainer(trainer, samples) == 0.0
    assert any(routed)

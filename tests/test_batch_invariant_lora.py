"""LoRA adapters served unmerged under `ContinuousBatchingConfig(batch_invariant=True)`: in a mixed batch (two
adapters, one training modules whole: peft's `modules_to_save`, and the base model, through chunked prefill and
preemption), every sampled token's log-prob equals the trainer's own forward bit for bit: peft's `PeftModel` with
that adapter set, under `trainer_bridge.batch_invariant`, in TRL's padded layout. In fp32 and bf16 (peft keeps the
adapters in fp32 over a bf16 base), on a model scaled to realistic entropy. The stacked product the engine runs
otherwise differs (so the comparison can fail)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_batch_invariant import realistic, trl_batch_logprobs

from conftest import make_engine, make_prompts, run_to_completion
from rollout import SamplingParams
from rollout.engine.lora.adapter_weights import from_peft_model
from trainer_bridge import batch_invariant

ADAPTERS = [None, "saving", "plain"]


def peft_pair(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base, PeftModel over a copy of it with "saving": LoRA on q/v, embed_tokens, o_proj, the final norm and the head trained
    whole, and "plain": LoRA on the other linears), the adapters' weights random (trained away from peft's zero B)."""
    base = realistic("llama_wide_mha", dtype)
    torch.manual_seed(6)
    saving = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["embed_tokens", "o_proj", "model.norm", "lm_head"],
    )
    model = get_peft_model(copy.deepcopy(base), saving, adapter_name="saving")
    plain = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]  # not o_proj: "saving" trains it
    model.add_adapter("plain", LoraConfig(r=4, lora_alpha=12, target_modules=plain))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.1)
            elif "modules_to_save.saving" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return base, model.eval()


def sample_mixed(engine, prompts: list[list[int]]) -> dict[str | None, list[tuple[list[int], list[int], torch.Tensor]]]:
    """A group of 2 per prompt and adapter, all in flight together; (prompt, completion, log-probs) by adapter."""
    for index, prompt in enumerate(prompts):
        for adapter in ADAPTERS:
            sampling = SamplingParams(temperature=1.0, seed=index)
            engine.add_request(f"{adapter}-{index}", prompt, sampling, n=2, max_new_tokens=16, adapter=adapter)
    samples: dict[str | None, list] = {adapter: [] for adapter in ADAPTERS}
    for output in run_to_completion(engine).values():
        adapter = None if output.request_id.startswith("None") else output.request_id.split("-")[0]
        samples[adapter].append((list(output.prompt_ids), list(output.generated_tokens), torch.tensor(output.logprobs)))
    return samples


def largest_gap(trainer: torch.nn.Module, samples) -> float:
    """The largest |delta| between the engine's log-probs and the trainer's invariant forward (batches of 3 rows)."""
    gap = 0.0
    with torch.no_grad(), batch_invariant(trainer):
        for first in range(0, len(samples), 3):
            chunk = samples[first : first + 3]
            for (_, _, ours), theirs in zip(chunk, trl_batch_logprobs(trainer, [(p, c) for p, c, _ in chunk])):
                gap = max(gap, float((ours - theirs).abs().max()))
    return gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adapters_in_a_mixed_batch_equal_peft_under_the_trainers_mode_bit_for_bit(dtype, unknown_lengths):
    base, model = peft_pair(dtype)
    engine = make_engine(copy.deepcopy(base), batch_invariant=True, num_blocks=40, block_size=4, max_batch_tokens=12)
    # A base request first: the engine learns that the base model's forwards need no torch-function mode, so the
    # adapters loaded afterwards must compute invariantly on their own.
    engine.add_request("warm-up", make_prompts(1, 5, 5, seed=3)[0], SamplingParams(temperature=1.0), max_new_tokens=2)
    run_to_completion(engine)
    for adapter in ADAPTERS[1:]:
        engine.load_adapter(adapter, from_peft_model(model, adapter))
    samples = sample_mixed(engine, make_prompts(3, 3, 17, seed=4))
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    engine.close()
    assert all(len(rows) == 6 for rows in samples.values())
    assert largest_gap(base, samples[None]) == 0.0
    for adapter in ADAPTERS[1:]:
        model.set_adapter(adapter)
        assert largest_gap(model, samples[adapter]) == 0.0, adapter
    # The adapters are in effect: the base model's forward is far from their rows.
    assert largest_gap(base, samples["plain"]) > 1e-2

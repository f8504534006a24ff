"""`Engine.serve_adapter_from_start` on an idle engine that served requests already (it only refuses a busy one):
serving an adapter of a name again, replaced or after `unload_adapter`, keeps the policy version, so the prefixes
cached under the earlier adapter of that name must not serve the new one. Reference: peft's own forward."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import SamplingParams
from rollout.engine.lora.adapter_weights import LoraModule, from_peft_model

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def test_an_adapter_served_again_from_the_start_gets_no_prefix_of_the_one_before():
    base = tiny_model("qwen3", seed=0)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(reference_copy(base), config, adapter_name="a").eval()

    def new_weights() -> dict:
        with torch.no_grad():
            for name, parameter in peft.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn_like(parameter) * 0.1)
        modules = from_peft_model(peft, "a")
        return {key: LoraModule(m.lora_A.clone(), m.lora_B.clone(), m.scaling) for key, m in modules.items()}

    prompt = make_prompts(1, 24, 24, seed=3)[0]
    engine = make_engine(copy.deepcopy(base), num_blocks=64, block_size=4)

    def worst_error(request_id: str) -> float:
        engine.add_request(request_id, prompt, GREEDY, max_new_tokens=8, adapter="a")
        out = run_to_completion(engine)[request_id]
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([prompt + list(out.generated_tokens)])).logits[0]
        expected = logits.float().log_softmax(-1)[len(prompt) - 1 :]
        return max(
            abs(expected[j, t].item() - got) for j, (t, got) in enumerate(zip(out.generated_tokens, out.logprobs))
        )

    engine.serve_adapter_from_start("a", new_weights())
    assert worst_error("first") < 1e-4
    engine.serve_adapter_from_start("a", new_weights())  # replaced while idle: the same policy version
    assert worst_error("replaced") < 1e-4
    engine.unload_adapter("a")
    engine.serve_adapter_from_start("a", new_weights())
    assert worst_error("served again") < 1e-4
    engine.close()


def test_the_per_token_adapter_slots_are_allocated_at_the_first_adapter_step_not_when_built():
    """An engine that never serves an adapter holds no per-token slot buffer (at max_batch_tokens 2**24 it was 128 MB
    of longs, allocated when the engine was built); the first step with an adapter allocates it, and serves as peft."""
    base = tiny_model("qwen3", seed=0)
    engine = make_engine(copy.deepcopy(base), num_blocks=64, block_size=4, max_batch_tokens=1 << 22)
    state = engine.runner.adapters.state
    prompt = make_prompts(1, 12, 12, seed=5)[0]
    engine.add_request("base", prompt, GREEDY, max_new_tokens=4)
    run_to_completion(engine)
    assert state.token_slots.numel() == 0
    torch.manual_seed(2)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(reference_copy(base), config, adapter_name="a").eval()
    engine.load_adapter("a", from_peft_model(peft, "a"))
    engine.add_request("lora", prompt, GREEDY, max_new_tokens=4, adapter="a")
    out = run_to_completion(engine)["lora"]
    assert state.token_slots.numel() == 1 << 22
    with torch.no_grad():
        expected = peft.generate(input_ids=torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert list(out.generated_tokens) == expected[0, len(prompt) :].tolist()
    engine.close()

"""Decode graphs captured while an adapter is served (a worker started with --lora captures them at warmup, after
serving it): the capture runs the step on padding rows, every token on the base, and the LoRA hooks read each
token's slot from the per-token buffer. Allocated lazily at the first step that serves an adapter, the buffer was
still empty at that capture: its forward failed, so CUDA graphs were turned off for the worker's life (decode ran
eagerly). On CPU the capture's work (`_step` inside `capture_graphs`' stepping) runs eagerly; reference: peft."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import SamplingParams
from rollout.engine.lora.adapter_weights import from_peft_model

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def test_decode_graphs_captured_with_an_adapter_served_from_the_start_run_their_step():
    base = tiny_model("qwen3", seed=0)
    engine = make_engine(copy.deepcopy(base), num_blocks=32, block_size=16, attention_backend="triton")
    graphs = engine.runner.enable_decode_graphs(4, engine.max_model_len, capture=False)
    torch.manual_seed(2)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(reference_copy(base), config, adapter_name="a").eval()
    engine.serve_adapter_from_start("a", from_peft_model(peft, "a"))
    with torch.inference_mode(), engine.runner._stepping():  # what capture_graphs enters (`_capture_in_pool`'s work)
        for size in (4, 2, 1):
            graphs._pad(0, size)
            assert graphs._step(size).shape[0] == size
    prompt = make_prompts(1, 12, 12, seed=5)[0]
    engine.add_request("lora", prompt, GREEDY, max_new_tokens=4, adapter="a")
    out = run_to_completion(engine)["lora"]
    with torch.no_grad():
        expected = peft.generate(input_ids=torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert list(out.generated_tokens) == expected[0, len(prompt) :].tolist()
    engine.close()

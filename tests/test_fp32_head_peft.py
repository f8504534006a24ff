"""`fp32_logits` on a PEFT model with a LoRA on its output head (what `ColocatedEngine` serves in a trainer). The fp32
projection was hooked on peft's wrapper of the head, so its product replaced the wrapper's whole output: the rollout
sampled from the base head, the adapter's delta left out, with no error. It now computes the wrapped base layer's
product, over which peft adds the delta. The reference: peft's own `generate`, adapters on and off."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from rollout import ContinuousBatchingConfig, Engine, SamplingParams
from rollout.presets import tiny_model

PROMPT = [5, 6, 7]
NEW_TOKENS = 6


@torch.no_grad()
def test_a_lora_on_the_head_is_served_with_fp32_logits():
    model = get_peft_model(tiny_model(0, torch.bfloat16), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.normal_(0, 0.5)
    model.eval()
    ids = torch.tensor([PROMPT])
    with_adapter = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT) :].tolist()
    with model.disable_adapter():
        base = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT) :].tolist()
    assert with_adapter != base, "the check could not tell the adapter from the base"
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=64, fp32_logits=True))
    try:
        greedy = SamplingParams(do_sample=False, max_new_tokens=NEW_TOKENS, stop_token_ids=())
        engine.add_request("head", PROMPT, greedy)
        served = None
        while engine.has_unfinished():
            served = next((o.generated_tokens for o in engine.step() if o.is_finished), served)
    finally:
        engine.close()
    assert served == with_adapter  # was the base head's tokens

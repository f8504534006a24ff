"""PeftModels over the tiny model a test worker starts with (`tiny_model(0)`), with random non-zero adapters, and
peft's own greedy generate of them: what adapter pushes to a real worker are compared against."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from rollout.presets import tiny_model


def lora_model(seed: int, **config) -> torch.nn.Module:
    """A PeftModel over the worker's own start model (tiny seed 0) with a random, non-zero adapter."""
    torch.manual_seed(seed)
    settings = dict(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False) | config
    model = get_peft_model(tiny_model(0), LoraConfig(**settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def peft_greedy(model, prompt: list[int], max_new_tokens: int = 12) -> list[int]:
    """peft's greedy continuation of `prompt`, exactly `max_new_tokens` tokens."""
    with torch.no_grad():
        output = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return output[0, len(prompt) :].tolist()

"""LoRA variants peft adds over time (DoRA, aLoRA, Arrow, KaSA, BD-LoRA, ... each a forward of its own, flagged
`is_lora_variant` in `LoraConfig`'s field metadata, or an `init_lora_weights` value listed in its `lora_variants`):
rollout (peft>=0.14, unpinned above) refuses every one peft flags by name, so that a variant a later peft adds is never
served as plain LoRA, silently wrong; MiCA, whose forward is plain LoRA, is served as peft computes it."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import FieldError, SamplingParams
from rollout.engine.lora.adapter_weights import from_peft_model
from rollout.peft_adapters import check_peft_config
from trainer_bridge.weights.adapter_mode import push_mode

SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)
NEW = 6


@dataclasses.dataclass
class LaterLoraConfig(LoraConfig):
    """A `LoraConfig` as a later peft may have it: one more variant field, and one more `init_lora_weights` variant
    (a stand-in: what matters is how peft flags them)."""

    later_config: dict | None = dataclasses.field(default=None, metadata={"is_lora_variant": True})
    init_lora_weights: bool | str = dataclasses.field(default=True, metadata={"lora_variants": ["mica", "later"]})


def peft_model(seed: int = 1, **config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base model, PeftModel over a copy of it, q_proj and down_proj adapted, every LoRA tensor off its init)."""
    base = tiny_model("qwen3", seed=0)
    torch.manual_seed(seed)
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]) | config
    model = get_peft_model(reference_copy(base), LoraConfig(**settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return base, model.eval()


def later(model: torch.nn.Module, **changes) -> None:
    """Give `model`'s adapter a `LaterLoraConfig` with `changes` (its tensors and forward stay plain LoRA's)."""
    current = model.peft_config["default"]
    fields = {f.name: getattr(current, f.name) for f in dataclasses.fields(LoraConfig) if f.init}
    config = LaterLoraConfig(**fields)
    for name, value in changes.items():
        setattr(config, name, value)
    model.peft_config["default"] = config


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"later_config": {"k": 1}}, "later_config"), ({"init_lora_weights": "later"}, "init_lora_weights")],
    ids=["variant-field", "init-variant"],
)
def test_a_variant_peft_flags_is_refused_by_name_and_pushed_merged(changes, field):
    _, model = peft_model()
    later(model, **changes)
    with pytest.raises(FieldError, match="not served unmerged") as error:
        check_peft_config(model.peft_config["default"])
    assert error.value.field == field
    with pytest.raises(FieldError) as error:
        from_peft_model(model)
    assert error.value.field == field
    with pytest.raises(FieldError) as error:
        push_mode(model, "adapter")
    assert error.value.field == field
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert push_mode(model, "auto") == "merged"
    assert any(field in str(warning.message) for warning in warned)


def test_the_same_settings_unset_and_mica_are_served_as_peft_computes_them():
    """The stand-in's fields unset are plain LoRA; MiCA (a variant with plain LoRA's forward) is served unmerged,
    fp32 log-probs within 1e-5 of peft's forward."""
    _, plain = peft_model()
    later(plain)
    check_peft_config(plain.peft_config["default"])
    base, model = peft_model(init_lora_weights="mica")
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter("mica", from_peft_model(model))
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    engine.add_request("sampled", prompt, SAMPLED, max_new_tokens=NEW, adapter="mica")
    output = run_to_completion(engine)["sampled"]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output.generated_tokens])).logits[0, len(prompt) - 1 : -1]
    tokens = torch.tensor(output.generated_tokens).unsqueeze(1)
    reference = torch.log_softmax(logits.float(), -1).gather(1, tokens).squeeze(1)
    assert torch.allclose(torch.tensor(output.logprobs), reference, atol=1e-5, rtol=0)

"""Adapter names no reply can carry: a lone surrogate (JSON's "\\ud800", which `/v1/load_lora_adapter`'s body may
hold) and the Unicode line and paragraph separators. Once served, a surrogate name made every ZeroMQ reply that lists
the served adapters fail to encode (`weights_spec_reply`, so every later weight push, and `stats`); such names are
refused by name, nothing served, and a good adapter loads and serves as peft computes it after them."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout import protocol as p
from rollout.config import FieldError, SamplingParams
from rollout.engine.lora.adapter_weights import from_peft_model
from rollout.engine.manager.weight_queue import adapter_update

SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)
NEW = 6
BAD_NAMES = {"a\ud800": "lone surrogate", "a\u2028b": "line separator", "a\u2029b": "paragraph separator"}


@pytest.fixture(scope="module")
def trained():
    """(base model, PeftModel over a copy of it): LoRA on q_proj and v_proj moved off its init."""
    base = tiny_model("qwen3", seed=0)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(reference_copy(base), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return base, model.eval()


@pytest.mark.parametrize("name", list(BAD_NAMES))
def test_a_name_no_reply_can_carry_is_refused_by_name(trained, name):
    base, model = trained
    engine = make_engine(copy.deepcopy(base))
    with pytest.raises(FieldError, match=BAD_NAMES[name]) as error:
        engine.load_adapter(name, from_peft_model(model))
    assert error.value.field == "adapter" and not engine.runner.adapters.refs
    with pytest.raises(FieldError, match=BAD_NAMES[name]) as error:  # the manager's (and HTTP route's) way in
        adapter_update(name, from_peft_model(model))
    assert error.value.field == "name"
    # What a worker sends its trainers after an adapter load encodes (a surrogate name made it raise).
    reply = p.WeightsSpecReply(
        "u", [], engine.policy_version, None, {n: r.version for n, r in engine.runner.adapters.refs.items()}
    )
    p.encode(reply)
    # A good adapter loads after the refusals and serves as peft computes it.
    engine.load_adapter("good", from_peft_model(model))
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    engine.add_request("sampled", prompt, SAMPLED, max_new_tokens=NEW, adapter="good")
    output = run_to_completion(engine)["sampled"]
    with torch.inference_mode():
        ids = torch.tensor([prompt + output.generated_tokens])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    tokens = torch.tensor(output.generated_tokens).unsqueeze(1)
    reference = torch.log_softmax(logits, -1).gather(1, tokens).squeeze(1)
    assert torch.allclose(torch.tensor(output.logprobs), reference, atol=1e-5, rtol=0)
    with pytest.raises(FieldError, match=BAD_NAMES[name]):  # a request naming it is refused too
        engine.add_request("r", prompt, SAMPLED, max_new_tokens=2, adapter=name)

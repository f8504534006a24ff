"""Adapters whose init rewrote the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: W becomes W - s B0 A0 when peft
builds the model) add to that rewritten base. A review found them served over the original base, silently 0.64 to
1.15 nats off peft's forward. Now a saved directory of one is refused by name, as is a live PEFT model's over an engine
that does not hold its base; the conversion peft offers (`path_initial_model_for_weight_conversion`: a plain LoRA of
twice the rank) is served as peft's forward of the trained model computes it."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, init_continuous_batching
from rollout.config import FieldError
from rollout.engine.lora.adapter_weights import load_peft_dir

SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)
NEW = 6
TIMEOUT = 60


def trained(base: torch.nn.Module, init: str, initial_dir=None) -> torch.nn.Module:
    """A PeftModel over a copy of `base` with `init`, its LoRA tensors moved off their init ("training"); the
    initial adapter saved to `initial_dir` first when given, as peft's conversion asks."""
    model = get_peft_model(
        reference_copy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    )
    if initial_dir is not None:
        model.peft_config["default"].init_lora_weights = True  # peft's documented step before saving the initial one
        model.save_pretrained(initial_dir)
        model.peft_config["default"].init_lora_weights = init
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def peft_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The teacher-forced log-probs of `tokens` after `prompt` in peft's own forward."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_saved_directory_is_refused_and_its_conversion_served_as_peft_computes_it(init, tmp_path):
    base = tiny_model("qwen3", seed=0)
    model = trained(base, init, tmp_path / "initial")
    model.save_pretrained(tmp_path / "as_trained")
    # peft runs the init again over the original base when it loads the directory: the trained model's forward
    loaded = PeftModel.from_pretrained(reference_copy(base), tmp_path / "as_trained").eval()
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    tokens = make_prompts(1, NEW, NEW, seed=5)[0]
    assert torch.allclose(peft_logprobs(loaded, prompt, tokens), peft_logprobs(model, prompt, tokens), atol=1e-5)
    with pytest.raises(FieldError, match=f"'{init}' rewrites the base weights.*path_initial_model_for_weight") as error:
        load_peft_dir(str(tmp_path / "as_trained"))
    assert error.value.field == "init_lora_weights"

    model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter("converted", load_peft_dir(str(tmp_path / "converted")))
    engine.add_request("sampled", prompt, SAMPLED, max_new_tokens=NEW, adapter="converted")
    output = run_to_completion(engine)["sampled"]
    reference = peft_logprobs(model, prompt, output.generated_tokens)
    assert torch.allclose(torch.tensor(output.logprobs), reference, atol=1e-5, rtol=0)


def test_a_live_model_is_served_over_its_own_base_and_refused_over_another():
    base = tiny_model("qwen3", seed=0)
    model = trained(base, "pissa")
    rewritten = copy.deepcopy(model).unload()  # the base peft rewrote, without the LoRA layers
    config = ContinuousBatchingConfig(num_blocks=256, block_size=4)
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    for served, over_its_base in ((copy.deepcopy(base), False), (rewritten, True)):
        manager = init_continuous_batching(served, None, config)
        manager.start()
        try:
            if not over_its_base:
                with pytest.raises(FieldError, match="'pissa' rewrote the PEFT model's base weights") as error:
                    manager.load_adapter("pissa", model)
                assert error.value.field == "init_lora_weights"
                continue
            manager.load_adapter("pissa", model)
            manager.add_request(prompt, request_id="x", max_new_tokens=NEW, sampling=SAMPLED, adapter="pissa")
            output = manager.get_result("x", timeout=TIMEOUT)
            while output is not None and not output.is_finished:
                output = manager.get_result("x", timeout=TIMEOUT)
            assert output is not None and output.is_finished
            reference = peft_logprobs(model, prompt, output.generated_tokens)
            assert torch.allclose(torch.tensor(output.logprobs), reference, atol=1e-5, rtol=0)
        finally:
            manager.stop(block=True, timeout=TIMEOUT)

"""Adapters that train modules whole (peft's `modules_to_save`: here the input embeddings and every o_proj) served
beside their LoRA layers, checked against peft's own forward of the same `PeftModel`: fp32 log-probs of a mixed
batch (this adapter, a plain LoRA adapter and the base in the same steps; peft's reference runs each row with its
adapter set, as its `adapter_names=` forward cannot mix an adapter without modules_to_save in), a PEFT directory,
and refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora import MAX_NEW, peft_greedy

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import FieldError, SamplingParams
from rollout.engine.lora.adapter_weights import SavedModule, from_peft_model, load_peft_dir

SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)


@torch.inference_mode()
def peft_row_logprobs(model, adapter: str | None, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced fp32 log-probs of `tokens` after `prompt` under peft with `adapter` set (None: disabled)."""
    ids = torch.tensor([prompt + tokens])
    if adapter is None:
        with model.disable_adapter():
            logits = model(input_ids=ids).logits.float()
    else:
        model.set_adapter(adapter)
        logits = model(input_ids=ids).logits.float()
    log_probs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
    return log_probs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="module")
def saved_pair():
    """(base, PeftModel with "saving" (LoRA on q/v, embed_tokens and o_proj trained whole) and "plain" (LoRA))."""
    base = tiny_model("qwen3", seed=5)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    torch.manual_seed(6)
    saving = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "o_proj"]
    )
    model = get_peft_model(reference_copy(base), saving, adapter_name="saving")
    model.add_adapter("plain", LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
            elif "modules_to_save.saving" in name:  # trained away from the base
                parameter.add_(torch.randn_like(parameter) * 0.02)
    return base, model.eval()


def test_a_mixed_batch_with_saved_modules_matches_peft(saved_pair):
    base, model = saved_pair
    modules = from_peft_model(model, "saving")
    saved = sorted(name for name, weights in modules.items() if isinstance(weights, SavedModule))
    assert saved == ["model.embed_tokens"] + [f"model.layers.{i}.self_attn.o_proj" for i in range(2)]
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter("saving", modules)
    engine.load_adapter("plain", from_peft_model(model, "plain"))
    prompt = make_prompts(1, 20, 20, seed=8)[0]
    adapters = [None, "saving", "plain"]
    for adapter in adapters:
        engine.add_request(str(adapter), prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = run_to_completion(engine)
    for adapter in adapters:
        reference = peft_row_logprobs(model, adapter, prompt, outputs[str(adapter)].generated_tokens)
        got = torch.tensor(outputs[str(adapter)].logprobs)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0), (adapter, (got - reference).abs().max())
    # Without the saved modules the "saving" adapter samples differently: they are in effect.
    lora_only = {name: weights for name, weights in modules.items() if not isinstance(weights, SavedModule)}
    engine.load_adapter("saving", lora_only)
    engine.add_request("lora-only", prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter="saving")
    again = run_to_completion(engine)["lora-only"]
    assert torch.tensor(again.logprobs).sub(torch.tensor(outputs["saving"].logprobs)).abs().max() > 1e-3
    engine.close()


def test_saved_norms_are_served_like_peft_and_head_norms_are_refused(saved_pair):
    """Norms over the hidden states trained whole (every input_layernorm and the final norm) are served unmerged
    beside the base in one batch, each row equal to peft's forward; q_norm (per attention head: its rows are tokens x
    heads) is refused by name, and the adapter served before keeps serving."""
    base, _ = saved_pair
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["input_layernorm", "model.norm"])
    model = get_peft_model(reference_copy(base), config, adapter_name="norms")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "modules_to_save.norms" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.eval()
    modules = from_peft_model(model, "norms")
    saved = sorted(name for name, weights in modules.items() if isinstance(weights, SavedModule))
    assert saved == ["model.layers.0.input_layernorm", "model.layers.1.input_layernorm", "model.norm"]
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter("norms", modules)
    prompt = make_prompts(1, 16, 16, seed=4)[0]
    for adapter in (None, "norms"):
        engine.add_request(str(adapter), prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = run_to_completion(engine)
    for adapter in (None, "norms"):
        reference = peft_row_logprobs(model, adapter, prompt, outputs[str(adapter)].generated_tokens)
        got = torch.tensor(outputs[str(adapter)].logprobs)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0), (adapter, (got - reference).abs().max())
    lora_only = {name: weights for name, weights in modules.items() if not isinstance(weights, SavedModule)}
    heads = get_peft_model(reference_copy(base), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["q_norm"]))
    with pytest.raises(FieldError) as error:
        engine.load_adapter("norms", {**lora_only, **from_peft_model(heads, "default")})
    assert error.value.field == "model.layers.0.self_attn.q_norm.modules_to_save.weight"
    assert "Qwen3RMSNorm is not served unmerged" in error.value.reason
    engine.add_request("still", prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter="norms")
    still = run_to_completion(engine)["still"]
    assert still.generated_tokens == outputs["norms"].generated_tokens
    assert torch.allclose(torch.tensor(still.logprobs), torch.tensor(outputs["norms"].logprobs), atol=1e-5, rtol=0)
    engine.load_adapter("norms", lora_only)  # without the norms' copies it samples otherwise
    engine.add_request("lora-only", prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter="norms")
    again = torch.tensor(run_to_completion(engine)["lora-only"].logprobs)
    assert again.sub(torch.tensor(outputs["norms"].logprobs)).abs().max() > 1e-3
    engine.close()


def test_a_saved_directory_is_served_and_bad_saved_modules_are_refused(tmp_path, saved_pair):
    base, model = saved_pair
    model.save_pretrained(tmp_path, selected_adapters=["saving"])
    engine = make_engine(copy.deepcopy(base), max_loras=2)
    engine.serve_adapter_from_start("saving", load_peft_dir(str(tmp_path / "saving")))
    prompt = make_prompts(1, 12, 12, seed=9)[0]
    engine.add_request(
        "x", prompt, SamplingParams(do_sample=False, stop_token_ids=()), max_new_tokens=MAX_NEW, adapter="saving"
    )
    assert run_to_completion(engine)["x"].generated_tokens == peft_greedy(model, "saving", prompt)
    good = from_peft_model(model, "saving")
    weight = good["model.embed_tokens"].params["weight"]
    cases = {
        "output head, wrong shape": (
            {"lm_head": SavedModule({"weight": weight[:, :5]})},
            "lm_head.modules_to_save.weight",
        ),
        "wrong shape": (
            {"model.embed_tokens": SavedModule({"weight": weight[:5]})},
            "model.embed_tokens.modules_to_save.weight",
        ),
        "unknown parameter": (
            {"model.embed_tokens": SavedModule({"weight": weight, "scale": weight})},
            "model.embed_tokens.modules_to_save.scale",
        ),
        "missing parameter": (
            {"model.layers.0.self_attn.o_proj": SavedModule({})},
            "model.layers.0.self_attn.o_proj.modules_to_save.weight",
        ),
    }
    for case, (modules, field) in cases.items():
        with pytest.raises(FieldError) as error:
            engine.load_adapter("saving", modules)
        assert error.value.field == field, case
    engine.add_request(
        "still", prompt, SamplingParams(do_sample=False, stop_token_ids=()), max_new_tokens=MAX_NEW, adapter="saving"
    )
    assert run_to_completion(engine)["still"].generated_tokens == peft_greedy(model, "saving", prompt)
    engine.close()


def test_a_load_that_fails_to_allocate_changes_nothing_served(saved_pair, monkeypatch):
    """Out of memory while a replacement's new saved copies are allocated: the adapter served before keeps serving,
    its LoRA rows and saved copies untouched."""
    import rollout.engine.lora.saved_modules as saved_modules

    base, model = saved_pair
    engine = make_engine(copy.deepcopy(base))
    modules = from_peft_model(model, "saving")
    lora_only = {name: weights for name, weights in modules.items() if not isinstance(weights, SavedModule)}
    engine.load_adapter("saving", lora_only)
    prompt = make_prompts(1, 12, 12, seed=9)[0]
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    engine.add_request("before", prompt, greedy, max_new_tokens=MAX_NEW, adapter="saving")
    before = run_to_completion(engine)["before"].generated_tokens

    def out_of_memory(module, dtype=None):
        raise torch.OutOfMemoryError("no room for the copy")

    monkeypatch.setattr(saved_modules, "_shadow", out_of_memory)
    moved = {name: w for name, w in modules.items()}
    with pytest.raises(torch.OutOfMemoryError):
        engine.load_adapter("saving", moved)
    engine.add_request("after", prompt, greedy, max_new_tokens=MAX_NEW, adapter="saving")
    assert run_to_completion(engine)["after"].generated_tokens == before
    engine.close()


def test_pushes_of_models_with_saved_modules():
    """A merged (whole) push of a model whose active adapter saves nothing still sends the frozen original of a
    module another adapter saves; an adapter-only push of an adapter saving the output head sends the head's copy,
    one saving a norm over the hidden states sends its copy, one saving a module workers cannot serve unmerged (a norm
    per attention head) is refused up front."""
    from rollout.config import FieldError
    from trainer_bridge.gathering import peft_entries
    from trainer_bridge.weights.lora_push import adapter_push

    base = tiny_model("qwen3", seed=5)
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    model = get_peft_model(reference_copy(base), config, adapter_name="saving")
    model.add_adapter("plain", LoraConfig(r=4, target_modules=["v_proj"]))
    model.set_adapter("plain")
    entries = {entry.name: entry for entry in peft_entries(model, merged=True)}
    assert torch.equal(entries["model.embed_tokens.weight"].fetch(), base.model.embed_tokens.weight)
    head = get_peft_model(reference_copy(base), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    sent = {entry.name: entry for entry in adapter_push(head).entries}
    assert torch.equal(sent["lm_head.modules_to_save.weight"].fetch(), base.lm_head.weight)
    norm = get_peft_model(
        reference_copy(base), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["model.norm"])
    )
    sent = {entry.name: entry for entry in adapter_push(norm).entries}
    assert torch.equal(sent["model.norm.modules_to_save.weight"].fetch(), base.model.norm.weight)
    heads = get_peft_model(reference_copy(base), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["k_norm"]))
    with pytest.raises(FieldError) as error:
        adapter_push(heads)
    assert error.value.field == "model.layers.0.self_attn.k_norm" and "Qwen3RMSNorm" in error.value.reason

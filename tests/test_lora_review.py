"""LoRA adapters a user or an attacker brings that the engine must either serve exactly as peft computes them or
refuse by name: PEFT directories (peft's own modules_to_save matching, malformed adapter_config.json values, LoRA on
an embedding), saved modules with submodules, adapter names with control characters, saved-module copies that free
memory cannot hold, and, on the trainer's side, adapters merged into their base (peft's merge_adapter) or on bare
parameters (MoE experts), which no push may send silently wrong."""

from __future__ import annotations

import copy
import fnmatch
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import FieldError, SamplingParams
from rollout.engine.lora import bounds
from rollout.engine.lora.adapter_weights import from_peft_model, load_peft_dir
from rollout.engine.lora.layers import layer_bytes
from trainer_bridge.weights.adapter_mode import push_mode

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)
NEW = 6


def trained(kind: str = "qwen3", **config):
    """(base model, PeftModel over a copy of it with adapter "default"): every trained tensor moved off its init."""
    base = tiny_model(kind, seed=0)
    torch.manual_seed(1)
    model = get_peft_model(reference_copy(base), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return base, model.eval()


def assert_served_as_peft(base, model, modules) -> None:
    """Greedy tokens equal peft's generate; sampled tokens' fp32 log-probs equal peft's forward within 1e-5."""
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter("a", modules)
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    engine.add_request("greedy", prompt, GREEDY, max_new_tokens=NEW, adapter="a")
    engine.add_request("sampled", prompt, SAMPLED, max_new_tokens=NEW, adapter="a")
    outputs = run_to_completion(engine)
    ids = torch.tensor([prompt])
    expected = model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
    assert outputs["greedy"].generated_tokens == expected.tolist()
    tokens = outputs["sampled"].generated_tokens
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(outputs["sampled"].logprobs), reference, atol=1e-5, rtol=0)


def test_a_directory_saves_modules_as_peft_matches_them(tmp_path):
    """modules_to_save=["layernorm"]: peft saves every module whose name ends so (input_layernorm and
    post_attention_layernorm); the directory is served as the live model is, equal to peft's forward."""
    base, model = trained(target_modules=["q_proj"], modules_to_save=["layernorm"])
    model.save_pretrained(tmp_path)
    modules = load_peft_dir(str(tmp_path))
    assert set(modules) == set(from_peft_model(model))
    assert any(name.endswith("post_attention_layernorm") for name in modules)
    assert_served_as_peft(base, model, modules)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"lora_alpha": "16"}, "lora_alpha"),
        ({"lora_alpha": None}, "lora_alpha"),
        ({"alpha_pattern": ["q_proj"]}, "alpha_pattern"),
        ({"alpha_pattern": {"q_proj(": 3}}, "alpha_pattern"),
        ({"alpha_pattern": {"q_proj": "3"}}, "alpha_pattern.q_proj"),
        ({"rank_pattern": {"v_proj": 2}}, "model.layers.*.self_attn.v_proj.lora_A"),  # the first layer read
    ],
)
def test_a_malformed_adapter_config_is_refused_by_name(tmp_path, change, field):
    """A value peft's own loading would fail on (or compute with garbage) is a FieldError naming the setting, never
    a TypeError or re.error (an HTTP 500)."""
    _, model = trained(target_modules=["q_proj", "v_proj"])
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(FieldError) as error:
        load_peft_dir(str(tmp_path))
    assert fnmatch.fnmatchcase(error.value.field, field), error.value


def test_a_directory_with_lora_on_an_embedding_is_refused_naming_it(tmp_path):
    _, model = trained(target_modules=["embed_tokens", "q_proj"])
    model.save_pretrained(tmp_path)  # peft saves the embedding's base weights beside its lora_embedding_A / _B
    with pytest.raises(FieldError, match="LoRA on an Embedding") as error:
        load_peft_dir(str(tmp_path))
    assert error.value.field == "model.embed_tokens"


def test_a_saved_module_with_submodules_is_refused_naming_it():
    base, model = trained(target_modules=["q_proj"], modules_to_save=["mlp"])
    engine = make_engine(copy.deepcopy(base))
    with pytest.raises(FieldError, match="'model.layers.0.mlp', a module with submodules"):
        engine.load_adapter("a", from_peft_model(model))
    assert not engine.runner.adapters.refs


@pytest.mark.parametrize("name", ["a\nb", "a\x00b", "policy\u200b", "a\u202eb"])
def test_adapter_names_with_control_or_invisible_characters_are_refused(name):
    base, model = trained(target_modules=["q_proj"])
    engine = make_engine(copy.deepcopy(base))
    with pytest.raises(FieldError, match="control or formatting character") as error:
        engine.load_adapter(name, from_peft_model(model))
    assert error.value.field == "adapter" and not engine.runner.adapters.refs
    engine.load_adapter("policy", from_peft_model(model))
    with pytest.raises(FieldError, match="control or formatting character"):
        engine.add_request("r", [1, 2, 3], GREEDY, max_new_tokens=2, adapter=name)


def test_saved_copies_that_free_memory_cannot_hold_are_refused_before_anything_changes(monkeypatch):
    """The head's copy (modules_to_save) counts against free memory with the stacked LoRA weights: one byte short is
    refused naming modules_to_save, nothing served; exactly enough is served as peft computes it."""
    base, model = trained(target_modules=["q_proj"], modules_to_save=["lm_head"])
    engine = make_engine(copy.deepcopy(base))
    table = engine.runner.adapters
    q_projs = [module for name, module in base.named_modules() if name.endswith("q_proj")]
    lora = sum(layer_bytes(linear, table.max_loras, table.max_rank) for linear in q_projs)
    head = base.get_output_embeddings().weight
    needed = lora + head.numel() * head.element_size()
    monkeypatch.setattr(bounds, "free_memory_bytes", lambda device: needed - 1)
    with pytest.raises(FieldError, match="GiB free; serve fewer adapters") as error:
        engine.load_adapter("a", from_peft_model(model))
    assert error.value.field == "modules_to_save" and not table.refs
    monkeypatch.setattr(bounds, "free_memory_bytes", lambda device: needed)
    assert_served_as_peft(base, model, from_peft_model(model))


def test_an_adapter_merged_into_its_base_is_never_pushed_adapter_only():
    """After peft's merge_adapter the base weights carry the adapter: an adapter-only push would have the workers
    add it a second time. "adapter" refuses naming the layer, "auto" pushes merged; unmerged, adapter-only again."""
    _, model = trained(target_modules=["q_proj", "v_proj"])
    assert push_mode(model, "adapter") == "adapter"
    model.merge_adapter()
    with pytest.raises(FieldError, match=r"merged into the base weights .*unmerge_adapter\(\) first") as error:
        push_mode(model, "adapter")
    assert error.value.field == "model.layers.0.self_attn.q_proj"
    with pytest.warns(UserWarning, match="merged into the base weights"):
        assert push_mode(model, "auto") == "merged"
    model.unmerge_adapter()
    assert push_mode(model, "auto") == push_mode(model, "adapter") == "adapter"


def test_lora_on_moe_experts_parameters_is_refused_adapter_only():
    """peft's target_parameters (MoE experts' stacked weights) are not served unmerged: an adapter-only push is refused
    naming them (merged pushes add peft's own delta: tests/test_lora_followups.py)."""
    _, model = trained("qwen3_moe", target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    with pytest.raises(FieldError) as error:
        push_mode(model, "adapter")
    assert "target_parameters" in f"{error.value.field} {error.value.reason}"


@pytest.mark.parametrize(
    ("adapter_base", "served", "warned"),
    [
        ("org/other-model", "org/tiny-model", True),  # another model of the same architecture: every shape fits
        ("org/tiny-model", "org/tiny-model-instruct", True),
        ("org/tiny-model", "org/tiny-model", False),
        ("org/tiny-model", "/data/checkpoints/tiny-model/", False),  # a local copy of the hub model
        ("org/tiny-model", "/hf/hub/models--org--tiny-model/snapshots/0123abc", False),  # the hub cache's copy
        (None, "org/tiny-model", False),  # the adapter names no base
        ("org/other-model", "", False),  # a model built from a config has no name
    ],
)
def test_an_adapter_of_another_base_model_is_served_with_a_warning_naming_both(
    tmp_path, caplog, adapter_base, served, warned
):
    """An adapter whose base_model_name_or_path names another model than the served one loaded silently (its shapes
    fit): it is served (neither peft nor vLLM refuses it; LoRAX warns) with a warning naming both models, through
    the manager's load_adapter (the HTTP route's and the worker's path); served exactly as peft computes it."""
    from rollout import ContinuousBatchingConfig, init_continuous_batching

    base, model = trained(target_modules=["q_proj", "v_proj"])
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": adapter_base}))
    served_model = copy.deepcopy(base)
    served_model.name_or_path = served
    manager = init_continuous_batching(served_model, None, ContinuousBatchingConfig(num_blocks=64, block_size=4))
    try:
        with caplog.at_level("WARNING", logger="rollout.engine.lora.adapter_weights"):
            manager.load_adapter("a", str(tmp_path))
    finally:
        manager.stop(block=True, timeout=10)
    warnings = [record.getMessage() for record in caplog.records if "base_model_name_or_path" in record.getMessage()]
    assert len(warnings) == int(warned), warnings
    if warned:
        assert repr(adapter_base) in warnings[0] and repr(served) in warnings[0]
    assert_served_as_peft(base, model, load_peft_dir(str(tmp_path)))


def test_an_adapter_directory_missing_a_file_is_refused_naming_the_file(tmp_path):
    """A directory without its weights file was read by peft as a hub repository id ("Repo id must be in the form
    'repo_name' or 'namespace/repo_name'"), which names neither the file nor what is wrong: both files are named."""
    _, model = trained(target_modules=["q_proj"])
    model.save_pretrained(tmp_path / "no_weights")
    (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
    with pytest.raises(FieldError) as refused:
        load_peft_dir(str(tmp_path / "no_weights"))
    assert refused.value.field == "lora"
    assert "adapter_model.safetensors" in refused.value.reason and "Repo id" not in refused.value.reason
    model.save_pretrained(tmp_path / "no_config")
    (tmp_path / "no_config" / "adapter_config.json").unlink()
    with pytest.raises(FieldError, match="no adapter_config.json in"):
        load_peft_dir(str(tmp_path / "no_config"))
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)  # peft's other weights file: still read
    assert set(load_peft_dir(str(tmp_path / "bin"))) == set(from_peft_model(model))


@pytest.mark.parametrize("value, refused", [(True, True), (0.5, True), ({"k": 1}, True), (None, False), (False, False)])
def test_a_setting_of_a_newer_peft_is_refused_unless_off(tmp_path, value, refused):
    """peft drops a config setting it does not know (a newer peft's LoRA variant flag) with only a Python warning,
    and the adapter loaded as plain LoRA: a set one is refused by name; one left off is served as peft serves it."""
    _, model = trained(target_modules=["q_proj"])
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_future_variant": value}))
    if refused:
        with pytest.raises(FieldError) as error:
            load_peft_dir(str(tmp_path))
        assert error.value.field == "use_future_variant" and "does not know" in error.value.reason
    else:
        assert set(load_peft_dir(str(tmp_path))) == set(from_peft_model(model))


# LoraConfig's settings that peft 0.14 (the oldest rollout[lora] takes) does not have: later pefts added them.
NEWER_THAN_PEFT_0_14 = {
    "alora_invocation_tokens", "arrow_config", "corda_config", "ensure_weight_tying", "kasa_config", "lora_ga_config",
    "monteclora_config", "peft_version", "qalora_group_size", "target_parameters", "trainable_token_indices",
    "use_bdlora", "use_qalora", "velora_config",
}  # fmt: skip


def test_a_plain_adapter_of_a_newer_peft_is_served_by_an_older_one(tmp_path):
    """A newer peft writes its version and qalora_group_size (16, used only with use_qalora) into every adapter's
    config: on an older peft (here 0.14's settings), a plain LoRA adapter so saved is no newer variant, and loads."""
    import dataclasses

    from rollout.engine.lora.adapter_files import check_known_settings

    _, model = trained(target_modules=["q_proj"])
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_version"] and saved["qalora_group_size"] and not saved["use_qalora"]  # what peft writes
    known = {field.name for field in dataclasses.fields(LoraConfig)} - NEWER_THAN_PEFT_0_14
    check_known_settings(str(tmp_path), known, "0.14.0")
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**saved, "use_qalora": True}))
    with pytest.raises(FieldError) as error:  # a variant the older peft would serve as plain LoRA: still refused
        check_known_settings(str(tmp_path), known, "0.14.0")
    assert error.value.field == "use_qalora"

"""Adapters that train the output head whole (peft's `modules_to_save=["lm_head"]`, alone or with `embed_tokens`)
served unmerged, checked against peft's own forward of the same `PeftModel`: fp32 log-probs of sampled tokens and of
prompts (sliced through the head) in a mixed batch (the base, two head-saving adapters and a plain LoRA adapter in the
same steps; peft's reference runs each row with its adapter set), greedy tokens against peft's generate, a model with
tied embeddings (peft's untied copies and its `ensure_weight_tying`, from a PEFT directory too), and the fp32 head
(`fp32_logits` on a bf16 model): an adapter's copy computed in fp32 as the base head is."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora import MAX_NEW, peft_greedy
from test_lora_saved import SAMPLED, peft_row_logprobs
from transformers import AutoModelForCausalLM, Qwen3Config

from conftest import _COMMON, make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import SamplingParams
from rollout.engine.lora.adapter_weights import SavedModule, from_peft_model, load_peft_dir
from rollout.engine.sampling import prompt_logprobs

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
SCORED = dataclasses.replace(SAMPLED, prompt_logprobs=0)
ADAPTERS = [None, "head", "both", "plain"]


def train_copies(model, adapters: tuple[str, ...], seed: int = 6) -> None:
    """Random LoRA weights, and each adapter's saved copies moved well away from the base (a trained head)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
            elif any(f"modules_to_save.{adapter}." in name for adapter in adapters):
                parameter.add_(torch.randn_like(parameter) * parameter.std() * 0.5)


@pytest.fixture(scope="module")
def head_pair():
    """(base, PeftModel with "head" (LoRA on q/v, lm_head saved), "both" (embed_tokens and lm_head saved) and
    "plain" (LoRA alone))."""
    base = tiny_model("qwen3", seed=5)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(reference_copy(base), config, adapter_name="head")
    both = LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj"], modules_to_save=["embed_tokens", "lm_head"])
    model.add_adapter("both", both)
    model.add_adapter("plain", LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj"]))
    train_copies(model, ("head", "both"))
    return base, model.eval()


def finished(outputs: dict) -> dict:
    """`outputs`, each checked to have run its MAX_NEW tokens (a step that failed ends its requests empty)."""
    for output in outputs.values():
        assert output.finish_reason == "length" and len(output.logprobs) == MAX_NEW, output.error
    return outputs


def served(base: torch.nn.Module, model, names: list[str], **config):
    engine = make_engine(copy.deepcopy(base), **config)
    for name in names:
        engine.load_adapter(name, from_peft_model(model, name))
    return engine


@torch.inference_mode()
def peft_prompt_logprobs(model, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    """fp32 log-probs of prompt[1:] under peft with `adapter` set (None: disabled)."""
    return peft_row_logprobs(model, adapter, prompt[:1], prompt[1:])


def test_a_mixed_batch_with_saved_heads_matches_peft(head_pair, monkeypatch):
    """Sampled and prompt log-probs of the four in one batch (the prompt sent through the head three rows at a time)
    equal peft's within 1e-5; the saved copies are in effect."""
    monkeypatch.setattr(prompt_logprobs, "MAX_SLICE_ELEMENTS", 3 * _COMMON["vocab_size"])
    base, model = head_pair
    modules = from_peft_model(model, "both")
    assert sorted(name for name, w in modules.items() if isinstance(w, SavedModule)) == [
        "lm_head",
        "model.embed_tokens",
    ]
    engine = served(base, model, ADAPTERS[1:])
    prompt = make_prompts(1, 20, 20, seed=8)[0]
    for adapter in ADAPTERS:
        engine.add_request(str(adapter), prompt, SCORED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = finished(run_to_completion(engine))
    for adapter in ADAPTERS:
        output = outputs[str(adapter)]
        reference = peft_row_logprobs(model, adapter, prompt, output.generated_tokens)
        got = torch.tensor(output.logprobs)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0), (adapter, (got - reference).abs().max())
        scored = torch.tensor(output.prompt_logprobs[1:])
        reference = peft_prompt_logprobs(model, adapter, prompt)
        assert torch.allclose(scored, reference, atol=1e-5, rtol=0), (adapter, (scored - reference).abs().max())
    # The head's copy changes what "head" samples: without it the same tokens score differently.
    lora_only = {name: w for name, w in from_peft_model(model, "head").items() if not isinstance(w, SavedModule)}
    engine.load_adapter("head", lora_only)
    engine.add_request("lora-only", prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter="head")
    again = finished(run_to_completion(engine))["lora-only"]
    assert torch.tensor(again.logprobs).sub(torch.tensor(outputs["head"].logprobs)).abs().max() > 1e-3
    engine.close()


def test_greedy_tokens_with_saved_heads_equal_peft_generate(head_pair):
    base, model = head_pair
    engine = served(base, model, ADAPTERS[1:])
    prompts = make_prompts(len(ADAPTERS), 6, 20, seed=4)
    for index, adapter in enumerate(ADAPTERS):
        engine.add_request(str(index), prompts[index], GREEDY, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = run_to_completion(engine)
    for index, adapter in enumerate(ADAPTERS):
        assert outputs[str(index)].generated_tokens == peft_greedy(model, adapter, prompts[index]), adapter
    engine.close()


@pytest.mark.parametrize("ensure_weight_tying", [False, True])
def test_tied_embeddings_with_both_saved_match_peft(tmp_path, ensure_weight_tying):
    """A model whose head is tied to its input embeddings, saving both: without ensure_weight_tying peft trains two
    independent copies (the base head stays tied to the base embeddings); with it, one copy serves both (and its
    directory holds the head's copy under lm_head, which modules_to_save does not list)."""
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_config(Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True)).eval()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    config = LoraConfig(
        r=4,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
        ensure_weight_tying=ensure_weight_tying,
    )
    model = get_peft_model(reference_copy(base), config, adapter_name="tied")
    train_copies(model, ("tied",))
    model.eval()
    head = model.base_model.model.lm_head.modules_to_save["tied"].weight
    embeddings = model.base_model.model.model.embed_tokens.modules_to_save["tied"].weight
    assert (head is embeddings) == ensure_weight_tying
    model.save_pretrained(tmp_path)
    engine = make_engine(copy.deepcopy(base))
    engine.load_adapter(
        "tied", load_peft_dir(str(tmp_path / "tied")) if ensure_weight_tying else from_peft_model(model)
    )
    prompt = make_prompts(1, 16, 16, seed=3)[0]
    for adapter in (None, "tied"):
        engine.add_request(str(adapter), prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = finished(run_to_completion(engine))
    for adapter in (None, "tied"):
        reference = peft_row_logprobs(model, adapter, prompt, outputs[str(adapter)].generated_tokens)
        got = torch.tensor(outputs[str(adapter)].logprobs)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0), (adapter, (got - reference).abs().max())
    engine.close()


def test_the_fp32_head_computes_saved_heads_in_fp32():
    """fp32_logits on a bf16 model: an adapter's head copy is held in fp32 (an fp32 push unrounded) and its rows are
    computed as the fp32 head computes the base's: a copy equal to the base head gives the base's log-probs bit for
    bit, beside a base request in the same steps (a bf16 product would differ)."""
    base = tiny_model("qwen3", seed=5)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    base = base.to(torch.bfloat16)
    engine = make_engine(copy.deepcopy(base), fp32_logits=True)
    assert engine.runner.fp32_head is not None
    same = base.lm_head.weight.detach().float()
    engine.load_adapter("same", {"lm_head": SavedModule({"weight": same})})
    prompt = make_prompts(1, 16, 16, seed=3)[0]
    for adapter in (None, "same"):
        engine.add_request(str(adapter), prompt, SCORED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = finished(run_to_completion(engine))
    assert len(outputs["same"].prompt_logprobs) == len(prompt)
    assert outputs["same"].generated_tokens == outputs["None"].generated_tokens
    assert outputs["same"].logprobs == outputs["None"].logprobs
    assert outputs["same"].prompt_logprobs == outputs["None"].prompt_logprobs
    finer = same + torch.randn_like(same) * 1e-4  # below bf16's resolution
    engine.load_adapter("same", {"lm_head": SavedModule({"weight": finer})})
    kept = engine.runner.adapters.modules_of("same")["lm_head"].params["weight"]
    assert kept.dtype == torch.float32 and torch.equal(kept, finer)
    engine.close()


def test_under_a_trainers_autocast_an_fp32_models_saved_heads_are_computed_as_its_fp32_head():
    """fp32_logits on an fp32 model under a trainer's bf16 autocast (a colocated round under TRL's
    cast_lm_head_to_fp32): the base head is computed in fp32 outside the autocast, and so must an adapter's copy be: a
    copy equal to the base head gives the base's log-probs bit for bit (it was computed in bf16 under the autocast)."""
    base = tiny_model("qwen3", seed=5)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    engine = make_engine(copy.deepcopy(base), fp32_logits=True)
    engine.load_adapter("same", {"lm_head": SavedModule({"weight": base.lm_head.weight.detach().clone()})})
    prompt = make_prompts(1, 16, 16, seed=3)[0]
    for adapter in (None, "same"):
        engine.add_request(str(adapter), prompt, SCORED, max_new_tokens=MAX_NEW, adapter=adapter)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = finished(run_to_completion(engine))
    engine.close()
    assert outputs["same"].generated_tokens == outputs["None"].generated_tokens
    assert outputs["same"].logprobs == outputs["None"].logprobs
    assert outputs["same"].prompt_logprobs == outputs["None"].prompt_logprobs

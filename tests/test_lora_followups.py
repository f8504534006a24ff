"""LoRA paths a review found wrong, checked against peft's own forward and generate: merged pushes of LoRA on bare
parameters (peft's `target_parameters`, MoE experts' stacked weights, which "all-linear" adds on an MoE model),
in-process and to a real `rollout-worker --model tiny-moe`; `/v1/load_lora_adapter` naming the field its client
sent; `generate_batch` leaving a merged PeftModel merged; and an adapter load that fails (out of memory) after new
base weights were checked, which must change nothing."""

from __future__ import annotations

import copy
import warnings

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora_push import GREEDY, PROMPT, peft_greedy

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout import generate_batch
from rollout.config import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.engine.lora import adapter_table
from rollout.engine.lora.adapter_weights import from_peft_model
from rollout.presets import tiny_moe_model
from service_helpers import Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient, push_weights
from trainer_bridge.gathering import iter_weights
from trainer_bridge.weights.adapter_mode import push_mode

pytestmark = pytest.mark.timeout(120)

ENGINE_GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=3)
NEW = 6
EXPERTS = {"target_modules": [], "target_parameters": ["mlp.experts.down_proj"]}


def trained(base: torch.nn.Module, seed: int = 1, **config) -> torch.nn.Module:
    """A PeftModel over a copy of `base` whose every trained tensor moved off its init."""
    torch.manual_seed(seed)
    model = get_peft_model(reference_copy(base), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config))
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@torch.inference_mode()
def peft_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """fp32 log-probs of `tokens` after `prompt` under peft's own forward."""
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def assert_engine_serves(engine, model, prompt: list[int]) -> None:
    """The engine's greedy tokens equal peft's generate; its sampled tokens' log-probs equal peft's forward."""
    engine.add_request("greedy", prompt, ENGINE_GREEDY, max_new_tokens=NEW)
    engine.add_request("sampled", prompt, SAMPLED, max_new_tokens=NEW)
    outputs = run_to_completion(engine)
    ids = torch.tensor([prompt])
    expected = model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
    assert outputs["greedy"].generated_tokens == expected.tolist()
    tokens = outputs["sampled"].generated_tokens
    reference = peft_logprobs(model, prompt, tokens)
    assert torch.allclose(torch.tensor(outputs["sampled"].logprobs), reference, atol=1e-5, rtol=0)


# ---- 1. LoRA on bare parameters, pushed merged -----------------------------------------------------------------
@pytest.mark.parametrize("config", [EXPERTS, {"target_modules": "all-linear"}], ids=["down_proj", "all-linear"])
def test_lora_on_moe_experts_is_pushed_merged_as_peft_computes_it(config):
    """ "auto" warns and pushes merged, "merged" pushes merged, "adapter" refuses naming target_parameters; what is
    sent (the experts' weights under their base names, with peft's delta) is served as peft's forward; after
    merge_adapter() the delta, now in the base, is sent once."""
    base = tiny_model("qwen3_moe", seed=0)
    model = trained(base, **config)
    with pytest.warns(UserWarning, match="target_parameters"):
        assert push_mode(model, "auto") == "merged"
    assert push_mode(model, "merged") == "merged"
    with pytest.raises(FieldError) as error:
        push_mode(model, "adapter")
    assert error.value.field == "target_parameters"
    sent = dict(iter_weights(model))
    assert set(sent) == set(base.state_dict())
    experts = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(sent[experts], base.state_dict()[experts])  # the delta is there
    engine = make_engine(copy.deepcopy(base))
    prompt = make_prompts(1, 9, 9, seed=4)[0]
    engine.update_weights(sent)
    assert_engine_serves(engine, model, prompt)
    model.merge_adapter()
    merged = dict(iter_weights(model))
    assert all(torch.allclose(merged[name], sent[name], atol=1e-6, rtol=0) for name in sent)
    engine.update_weights(merged)
    assert_engine_serves(engine, model, prompt)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A PEFT directory for the worker's tiny-moe model (q_proj)."""
    directory = tmp_path_factory.mktemp("adapters") / "good"
    trained(tiny_moe_model(0), target_modules=["q_proj"]).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def worker(adapter_dir):
    port = free_port()
    flags = ["--model", "tiny-moe", "--max-loras", "1", "--max-lora-rank", "8", "--http", f"127.0.0.1:{port}"]
    server = Worker(*flags, "--enable-control-routes", "--control-allowed-dirs", str(adapter_dir.parent))
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.close()


def test_experts_lora_pushed_to_a_worker_serves_peft_tokens_and_logprobs(worker):
    model = trained(tiny_moe_model(0), **EXPERTS)
    with RolloutClient(worker.address, timeout=60) as client:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "auto" says it pushes merged: checked above
            result = push_weights(client, model)
        assert client.adapter is None  # merged: the base serves it
        completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    assert completion.policy_versions == [[result.version, 0]] and completion.adapter is None
    assert completion.token_ids == peft_greedy(model, PROMPT)
    reference = peft_logprobs(model, PROMPT, completion.token_ids)
    assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-5, rtol=0)


# ---- 2. /v1/load_lora_adapter names lora_name --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a\nb", "policy\u200b", "__base__", "x" * 129])
def test_http_adapter_name_errors_name_lora_name(worker, adapter_dir, name):
    body = {"lora_name": name, "lora_path": str(adapter_dir)}
    response = httpx.post(f"{worker.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_name" and error["message"].startswith("lora_name: "), error


def test_http_a_good_adapter_name_loads(worker, adapter_dir):
    body = {"lora_name": "good", "lora_path": str(adapter_dir)}
    response = httpx.post(f"{worker.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == 200, response.text
    response = httpx.post(f"{worker.url}/v1/unload_lora_adapter", json={"lora_name": "good"}, timeout=30)
    assert response.status_code == 200, response.text


# ---- 3. generate_batch leaves a merged PeftModel merged -----------------------------------------------------------
def test_generate_batch_with_a_merged_adapter_leaves_it_merged():
    base = tiny_model("qwen3", seed=0)
    model = trained(base, target_modules=["q_proj", "v_proj"])
    model.merge_adapter()
    layers = [module for module in model.modules() if hasattr(module, "merged_adapters")]
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    prompt = make_prompts(1, 9, 9, seed=5)[0]
    ids = torch.tensor([prompt])
    adapted = model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, 9:].tolist()
    plain = base.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, 9:].tolist()
    assert adapted != plain
    outputs = generate_batch(
        model,
        [prompt, prompt],
        progress_bar=False,
        sampling=ENGINE_GREEDY,
        max_new_tokens=NEW,
        adapter=["default", None],
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=4),
    )
    assert outputs["req_0"].generated_tokens == adapted
    assert outputs["req_1"].generated_tokens == plain
    assert layers and all(layer.merged_adapters == ["default"] for layer in layers)
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter, weights[name], atol=1e-6, rtol=0), name


# ---- 3b. peft's own layers do not bound max_lora_rank -------------------------------------------------------------
def test_a_peft_gpt2_is_served_with_its_lora_layers_as_peft_runs_them():
    """GPT-2's layers are Conv1D: a PeftModel of it has no Linear layers but peft's own lora_A/lora_B (rank 4). They
    bounded max_lora_rank (16 by default), so every call was refused; the model now decodes as peft's `generate`, and
    naming its adapter is refused by name (LoRA on a Conv1D is not served unmerged)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=0))
    model = trained(base.eval(), target_modules=["c_attn", "c_fc"], fan_in_fan_out=True).eval()
    prompt = make_prompts(1, 7, 7, seed=3, vocab=128)[0]
    ids = torch.tensor([prompt])
    adapted = model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with model.disable_adapter():
        plain = model.generate(input_ids=ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert adapted.tolist() != plain.tolist()
    config = ContinuousBatchingConfig(num_blocks=32, block_size=4)
    outputs = generate_batch(
        model, [prompt], sampling=ENGINE_GREEDY, max_new_tokens=NEW, continuous_batching_config=config
    )
    assert outputs["req_0"].generated_tokens == adapted[0, len(prompt) :].tolist()
    with pytest.raises(FieldError, match="LoRA on a Conv1D is not served unmerged"):
        generate_batch(model, [prompt], max_new_tokens=NEW, adapter="default", continuous_batching_config=config)


# ---- 4. an adapter load that fails with new base weights changes nothing ------------------------------------------
def test_an_adapter_that_fails_to_load_leaves_the_old_base_and_adapters_serving(monkeypatch, caplog):
    """The base travels with the adapter (an adapter push to a worker without the trainer's base): when the
    adapter's layers cannot be allocated, the old base and adapter serve on, at the old version, tokens as before."""
    engine = make_engine(tiny_model("qwen3", seed=0))
    old = from_peft_model(trained(tiny_model("qwen3", seed=0), target_modules=["q_proj"]))
    new = from_peft_model(trained(tiny_model("qwen3", seed=0), seed=2, target_modules=["v_proj"]))  # new layers
    engine.load_adapter("a", old)
    prompt = make_prompts(1, 20, 20, seed=6)[0]

    def answers() -> dict:
        for adapter in (None, "a"):
            engine.add_request(f"{adapter}", prompt, ENGINE_GREEDY, max_new_tokens=NEW, adapter=adapter)
        return {key: output.generated_tokens for key, output in run_to_completion(engine).items()}

    before, version = answers(), engine.policy_version
    other_base = tiny_model("qwen3", seed=7).state_dict()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(adapter_table, "LoraLayer", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as error:
        engine.load_adapter("b", new, base=other_base)
    assert engine.policy_version == version and "b" not in engine.runner.adapters.refs
    assert answers() == before
    assert "adapter 'b'" in str(error.value) and "nothing changed" in str(error.value)
    monkeypatch.undo()
    assert "came with other base weights" not in caplog.text  # (refused: nothing changed)
    # The same update, with memory, while a group of adapter "a" runs: the new base serves, and adapter "a", pushed
    # for the weights before, is no longer served (it computed over the new base, a warning said so): its group
    # ends with an error saying why, as does a request naming it later, until it is pushed again with its base.
    engine.add_request("running", prompt, ENGINE_GREEDY, max_new_tokens=NEW, adapter="a")
    engine.step()
    result = engine.load_adapter("b", new, base=other_base)
    assert engine.policy_version == version + 1 and "a" not in engine.runner.adapters.refs
    ended = [output for output in result.outputs if output.is_finished]
    why = "adapter 'a' is no longer served: adapter 'b' came with other base weights than the ones 'a' was pushed for"
    assert [(output.request_id, output.finish_reason) for output in ended] == [("running", "error")]
    assert why in ended[0].error
    with pytest.raises(FieldError, match=why):
        engine.add_request("later", prompt, ENGINE_GREEDY, max_new_tokens=NEW, adapter="a")
    engine.add_request("None", prompt, ENGINE_GREEDY, max_new_tokens=NEW)
    assert run_to_completion(engine)["None"].generated_tokens != before["None"]
    assert "adapter 'b' came with other base weights: the adapters ['a'], pushed for the weights before" in caplog.text
    engine.load_adapter("a", old, base=tiny_model("qwen3", seed=0).state_dict())  # pushed again, with its base
    assert answers() == before and "b" not in engine.runner.adapters.refs

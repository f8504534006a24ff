"""Adapters and stale KV that cannot poison shared state (issue 48): an adapter whose scaling or values can overflow the
served dtype is refused by name (engine API, a PEFT directory, with and without check_finite), a realistic one still
loads; a sample whose logits turn non-finite ends with an error naming its adapter, its blocks never enter the prefix
cache, and base requests beside it and after it (reusing its blocks) get what a fresh engine gives; NaN left in free
blocks never reaches a new owner on either attention path; and the LoRA limits that are refused by name."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, needs_triton_interpreter, reference_copy, run_to_completion, tiny_model
from rollout.config import FieldError, SamplingParams
from rollout.engine.lora.adapter_weights import LoraModule, load_peft_dir
from rollout.engine.lora.bounds import check_magnitudes

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
MODULE = "model.layers.0.self_attn.q_proj"
MAX_NEW = 6


def realistic(model: torch.nn.Module, module: str = MODULE, rank: int = 4, seed: int = 0) -> LoraModule:
    """A LoRA pair of trained size on `module`: entries around 1e-2, scaling 2."""
    linear = model.get_submodule(module)
    generator = torch.Generator().manual_seed(seed)
    lora_A = torch.randn(rank, linear.in_features, generator=generator) * 0.01
    return LoraModule(lora_A, torch.randn(linear.out_features, rank, generator=generator) * 0.01, 2.0)


@pytest.fixture(scope="module")
def base():
    return tiny_model("qwen3", seed=3)


@pytest.fixture(scope="module")
def engine(base):
    return make_engine(copy.deepcopy(base))


@pytest.mark.parametrize("check_finite", [False, True])
@pytest.mark.parametrize(
    "attack, field",
    [
        ("lora_B", f"{MODULE}.lora_B"),  # lora_B = 1e30
        ("lora_A", f"{MODULE}.lora_A"),
        ("scaling", f"scalings.{MODULE}"),  # scaling -1e38
        ("alpha", f"scalings.{MODULE}"),  # lora_alpha 1e38 (scaling 2.5e37 at r=4)
        ("nan", f"{MODULE}.lora_B"),
    ],
)
def test_an_overflowing_adapter_is_refused_by_name(engine, attack, field, check_finite):
    pair = realistic(engine.model)
    if attack in ("lora_A", "lora_B"):
        getattr(pair, attack)[0, 0] = 1e30
    elif attack == "nan":
        pair.lora_B[1, 1] = float("nan")
    else:
        pair.scaling = -1e38 if attack == "scaling" else 1e38 / pair.rank
    with pytest.raises(FieldError) as error:
        engine.load_adapter("evil", {MODULE: pair}, check_finite=check_finite)
    assert error.value.field == field
    assert ("NaN" if attack == "nan" else "overflow") in error.value.reason
    assert "evil" not in engine.runner.adapters.refs  # nothing changed
    engine.load_adapter("fine", {MODULE: realistic(engine.model)}, check_finite=check_finite)
    assert engine.runner.adapters.refs["fine"].version == engine.policy_version


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_real_adapters_pass_and_the_bound_follows_the_dtype(dtype):
    """Adapters of a 4096-wide model pass in every dtype: entries around 1e-2 (rank 16), and peft's own
    initialisation of A (kaiming uniform, bound 1 / sqrt(in)) with a trained-size B at rank 64, alpha 128. One that
    amplifies its input 1e4-fold overflows float16's headroom (sqrt(65504) = 256) only."""
    generator = torch.Generator().manual_seed(0)
    small = LoraModule(torch.randn(16, 4096, generator=generator) * 0.01, torch.randn(4096, 16) * 0.01, 2.0)
    bound = 4096**-0.5
    peft_init = LoraModule((torch.rand(64, 4096) * 2 - 1) * bound, torch.randn(11008, 64) * 0.01, 2.0)
    check_magnitudes({"q": small, "up": peft_init}, dtype)
    loud = LoraModule(torch.full((4, 4096), 1.0), torch.full((4096, 4), 1.0), 0.15)  # gain 0.15 * 4 * 4096
    if dtype == torch.float16:
        with pytest.raises(FieldError, match=r"overflow a float16 model.*past 256"):
            check_magnitudes({"q": loud}, dtype)
    else:
        check_magnitudes({"q": loud}, dtype)


def saved_adapter(base, directory, **config) -> str:
    """A PEFT LoRA directory (`save_pretrained`) over q_proj and v_proj of `base`; B of trained size."""
    torch.manual_seed(1)
    model = get_peft_model(reference_copy(base), LoraConfig(target_modules=["q_proj", "v_proj"], **config))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.01)
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("attack", ["alpha", "lora_B"])
def test_an_overflowing_peft_directory_is_refused_by_name(base, tmp_path, attack):
    """`rollout-worker --lora NAME=DIR` serves it through `serve_adapter_from_start` (check_finite on); a manager's
    `load_adapter(name, DIR)` through `load_adapter` (check_finite off): both refuse it, naming the module."""
    config = dict(r=4, lora_alpha=1e38) if attack == "alpha" else dict(r=4, lora_alpha=8)
    path = saved_adapter(base, tmp_path / "evil", **config)
    if attack == "lora_B":
        from safetensors.torch import load_file, save_file

        weights = load_file(f"{path}/adapter_model.safetensors")
        key = next(key for key in weights if "q_proj.lora_B" in key)
        weights[key] = torch.full_like(weights[key], 1e30)
        save_file(weights, f"{path}/adapter_model.safetensors")
    expected = f"scalings.{MODULE}" if attack == "alpha" else f"{MODULE}.lora_B"
    engine = make_engine(copy.deepcopy(base))
    for load in (engine.serve_adapter_from_start, engine.load_adapter):
        with pytest.raises(FieldError) as error:
            load("evil", load_peft_dir(path))
        assert error.value.field == expected and "overflow" in error.value.reason
    engine.serve_adapter_from_start("fine", load_peft_dir(saved_adapter(base, tmp_path / "fine", r=4, lora_alpha=8)))
    assert sorted(engine.runner.adapters.refs) == ["fine"]


def break_adapter(engine, name: str) -> None:
    """Make a served adapter emit NaN, past every check (as a numeric accident would): NaN in its rows of A."""
    table = engine.runner.adapters
    rows = slice(table.refs[name].slot * table.max_rank, (table.refs[name].slot + 1) * table.max_rank)
    for layer in table._layers.values():
        layer.lora_A[rows] = float("nan")


def base_outputs(engine, prompts: list[list[int]], tag: str) -> dict:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{index}", prompt, GREEDY, max_new_tokens=MAX_NEW)
    return run_to_completion(engine)


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, output in got.items():
        assert output.finish_reason == "length", (key, output.error)
        assert output.generated_tokens == expected[key].generated_tokens, key
        torch.testing.assert_close(
            torch.tensor(output.logprobs), torch.tensor(expected[key].logprobs), atol=1e-5, rtol=0
        )


def test_non_finite_logits_end_the_sample_with_an_error_and_poison_nothing(base, monkeypatch):
    """A broken adapter's samples end with finish_reason "error" naming it, never token 0 / logprob -9999; base
    requests in the same steps, and later ones that reuse its blocks (a small cache), give a fresh engine's tokens
    and log-probs; its blocks left the prefix cache."""
    prompts = make_prompts(8, 9, 15, seed=4)
    fresh = make_engine(copy.deepcopy(base), num_blocks=24)
    expected_beside = base_outputs(fresh, prompts[:2], "beside")
    expected_after = base_outputs(fresh, prompts[2:], "after")

    engine = make_engine(copy.deepcopy(base), num_blocks=24)
    engine.load_adapter("evil", {MODULE: realistic(base)})
    break_adapter(engine, "evil")
    quarantined: list[int] = []
    quarantine = engine.block_manager.quarantine
    monkeypatch.setattr(
        engine.block_manager, "quarantine", lambda request: (quarantined.extend(request.block_ids), quarantine(request))
    )
    for index, prompt in enumerate(prompts[:3]):
        engine.add_request(f"evil{index}", prompt, GREEDY, max_new_tokens=MAX_NEW, adapter="evil")
    got = base_outputs(engine, prompts[:2], "beside")
    for index in range(3):
        output = got.pop(f"evil{index}")
        assert output.finish_reason == "error" and "adapter 'evil'" in output.error and "non-finite" in output.error
        assert not output.generated_tokens
    assert quarantined and not set(quarantined) & set(engine.block_manager.cached_blocks.values())
    assert_same(got, expected_beside)
    assert_same(base_outputs(engine, prompts[2:], "after"), expected_after)  # 6 x 6 blocks: every block reused
    engine.block_manager.check_all_free()


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=needs_triton_interpreter, id="triton-interpreted")]
)
def test_nan_left_in_free_blocks_never_reaches_a_new_owner(base, backend):
    """Every block but the scratch block full of NaN (what an undetected broken owner, e.g. one cancelled mid-prompt,
    could leave): requests of mixed lengths (padded groups, partial last blocks, chunked prefill) give a fresh
    engine's tokens and log-probs."""
    config = dict(num_blocks=32, block_size=16, attention_backend=backend, max_batch_tokens=24)
    prompts = make_prompts(4, 5, 40, seed=9)
    expected = base_outputs(make_engine(copy.deepcopy(base), **config), prompts, "r")
    engine = make_engine(copy.deepcopy(base), **config)
    engine.kv_cache.kv[:, :, : engine.kv_cache.num_blocks] = float("nan")
    assert_same(base_outputs(engine, prompts, "r"), expected)


def test_an_errored_sample_is_an_http_error_and_the_base_still_answers(base):
    """Over HTTP, the broken adapter's completion is a 500 naming it (not a 200 of token 0); the base's is a 200."""
    from rollout.config import ContinuousBatchingConfig
    from rollout.engine.manager.continuous_batching import init_continuous_batching
    from rollout.presets import tiny_model as tiny_preset
    from rollout.presets import tiny_tokenizer
    from rollout.service.http.serving.server import HttpServer
    from rollout.service.http.serving.settings import HttpSettings

    model = tiny_preset(seed=3)
    config = ContinuousBatchingConfig(num_blocks=32, block_size=16)
    manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=tiny_tokenizer()).start()
    http = HttpServer(manager, tiny_tokenizer(), HttpSettings(model_name="tiny")).start()
    try:
        manager.load_adapter("evil", {MODULE: realistic(model)})
        break_adapter(manager.engine, "evil")

        def complete(name: str) -> tuple[int, dict]:
            body = json.dumps({"model": name, "prompt": "hello there", "max_tokens": 4}).encode()
            request = urllib.request.Request(f"{http.url}/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as reply:
                    return reply.status, json.load(reply)
            except urllib.error.HTTPError as error:
                return error.code, json.load(error)

        status, answer = complete("evil")
        assert status == 500 and "adapter 'evil'" in answer["error"]["message"], answer
        status, answer = complete("tiny")
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    finally:
        http.stop()
        manager.stop()


def test_an_adapter_may_not_take_the_served_models_name(engine):
    engine.runner.adapters.reserved_names.add("tiny")
    for check in (
        lambda: engine.load_adapter("tiny", {MODULE: realistic(engine.model)}),
        lambda: engine.runner.adapters.check_specs("tiny", {f"{MODULE}.lora_A": ("float32", (4, 64))}),
    ):
        with pytest.raises(FieldError, match="served model's name") as error:
            check()
        assert error.value.field == "adapter"


def test_a_max_lora_rank_past_the_model_is_refused_by_name(base):
    with pytest.raises(FieldError, match="max_lora_rank: 100000000 is above 64") as error:
        make_engine(copy.deepcopy(base), max_lora_rank=100_000_000)
    assert error.value.field == "max_lora_rank"
    make_engine(copy.deepcopy(base), max_lora_rank=64)  # the highest useful rank is fine


def test_an_adapter_whose_layers_do_not_fit_free_memory_is_refused(engine, monkeypatch):
    from rollout.engine.lora import bounds as lora_bounds

    monkeypatch.setattr(lora_bounds, "free_memory_bytes", lambda device: 1024)
    module = "model.layers.1.mlp.down_proj"
    with pytest.raises(FieldError, match="GiB free; lower max_lora_rank or max_loras") as error:
        engine.load_adapter("big", {module: realistic(engine.model, module)})
    assert error.value.field == "max_lora_rank" and "big" not in engine.runner.adapters.refs


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora", "a=/x", "--lora", "a=/y"], "--lora a=/y: the adapter name 'a' is given twice"),
        (
            ["--lora", "tiny=/x"],
            "--lora tiny=/x: 'tiny' is the served model's name (--served-model-name, else --model)",
        ),
        (["--max-lora-rank", "100000000", "--num-blocks", "16"], "--max-lora-rank: 100000000 is above 256"),
    ],
)
def test_lora_flags_are_one_line_usage_errors(flags, message, capsys):
    from rollout.service.launch import cli

    with pytest.raises(SystemExit) as stop:
        cli.main([*flags, "--bind", "tcp://127.0.0.1:*"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

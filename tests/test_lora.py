"""LoRA adapters served unmerged, checked against peft's own forward and generate on the same `PeftModel`: greedy
tokens, fp32 log-probs of a mixed batch (two adapters and the base, peft's `adapter_names=` forward), bf16 drift
beside a merged model, repeated replacement, and refusals."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import FieldError, SamplingParams
from rollout.engine.generate import generate_batch
from rollout.engine.lora.adapter_weights import LoraModule, from_peft_model, load_peft_dir
from rollout.engine.requests.adapter_ref import BASE_NAME

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=7)
MAX_NEW = 12


def peft_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    """(base model, PeftModel over a copy of it with adapters "policy" (every Linear, r=8) and "other" (three
    projections, r=4, rsLoRA)); the base's head scaled to a realistic entropy, the adapters' B random and small."""
    base = tiny_model("qwen3", seed=seed)
    scale_to_entropy(base, make_prompts(4, 30, 60, seed=11))
    base = base.to(dtype)
    torch.manual_seed(seed + 1)
    policy = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(reference_copy(base), policy, adapter_name="policy")
    other = LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    model.add_adapter("other", other)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # non-zero, and small enough to keep the entropy realistic
                parameter.copy_(torch.randn_like(parameter) * 0.05)
    model.eval()
    return base, model


@pytest.fixture(scope="module")
def fp32_pair():
    return peft_model()


def served_engine(base: torch.nn.Module, model, **config):
    engine = make_engine(copy.deepcopy(base), **config)
    for name in ("policy", "other"):
        engine.load_adapter(name, from_peft_model(model, name))
    return engine


def peft_greedy(model, adapter: str | None, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    if adapter is None:
        with model.disable_adapter():
            return model.generate(input_ids=ids, **kwargs)[0, len(prompt) :].tolist()
    model.set_adapter(adapter)
    return model.generate(input_ids=ids, **kwargs)[0, len(prompt) :].tolist()


@torch.inference_mode()
def peft_logprobs(model, rows: list[tuple[str | None, list[int], list[int]]]) -> list[torch.Tensor]:
    """Teacher-forced fp32 log-probs of each row's tokens, all rows in one mixed-batch forward of peft
    (`adapter_names=`); rows have equal lengths."""
    ids = torch.tensor([prompt + tokens for _, prompt, tokens in rows])
    names = [BASE_NAME if adapter is None else adapter for adapter, _, _ in rows]
    logits = model(input_ids=ids, adapter_names=names).logits.float()
    result = []
    for row, (_, prompt, tokens) in enumerate(rows):
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
        log_probs = torch.log_softmax(logits[row, positions], -1)
        result.append(log_probs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1))
    return result


def test_greedy_tokens_of_each_adapter_match_peft_generate(fp32_pair):
    """Two prompts, each under the base and both adapters, all in one engine's batches (chunked prefill: a
    small token budget): every completion equals peft's generate with that adapter set (or disabled)."""
    base, model = fp32_pair
    engine = served_engine(base, model, max_batch_tokens=32)
    prompts = make_prompts(2, 6, 30, seed=5)
    adapters = [None, "policy", "other"]
    for index, prompt in enumerate(prompts):
        for adapter in adapters:
            engine.add_request(f"{index}-{adapter}", prompt, GREEDY, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = run_to_completion(engine)
    for index, prompt in enumerate(prompts):
        for adapter in adapters:
            output = outputs[f"{index}-{adapter}"]
            assert output.generated_tokens == peft_greedy(model, adapter, prompt), (index, adapter)
            assert output.adapter == adapter
            assert output.adapter_version == (None if adapter is None else engine.runner.adapters.refs[adapter].version)
    # The adapters change the model: not every completion is the base's.
    base_tokens = [outputs[f"{i}-None"].generated_tokens for i in range(2)]
    assert base_tokens != [outputs[f"{i}-policy"].generated_tokens for i in range(2)]
    engine.block_manager.check_all_free()


def test_mixed_batch_fp32_logprobs_match_peft_adapter_names_forward(fp32_pair):
    """One prompt sampled under the base and both adapters in the same steps; the log-probs of the sampled tokens
    equal peft's mixed-batch teacher-forced forward within 1e-5."""
    base, model = fp32_pair
    engine = served_engine(base, model)
    prompt = make_prompts(1, 20, 20, seed=6)[0]
    adapters = [None, "policy", "other"]
    for adapter in adapters:
        engine.add_request(str(adapter), prompt, SAMPLED, max_new_tokens=MAX_NEW, adapter=adapter)
    outputs = run_to_completion(engine)
    rows = [(adapter, prompt, outputs[str(adapter)].generated_tokens) for adapter in adapters]
    expected = peft_logprobs(model, rows)
    for adapter, reference in zip(adapters, expected):
        got = torch.tensor(outputs[str(adapter)].logprobs)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0), (adapter, (got - reference).abs().max())


def test_an_adapter_never_reuses_another_ones_prefix(fp32_pair):
    """The same long prompt under the base, then under an adapter: the adapter's request computes its prompt
    (no KV of the base is reused) and still matches peft."""
    base, model = fp32_pair
    engine = served_engine(base, model)
    prompt = make_prompts(1, 40, 40, seed=8)[0]
    engine.add_request("base", prompt, GREEDY, max_new_tokens=4)
    run_to_completion(engine)
    computed = engine.counters.computed_tokens
    engine.add_request("policy", prompt, GREEDY, max_new_tokens=MAX_NEW, adapter="policy")
    outputs = run_to_completion(engine)
    assert engine.counters.computed_tokens - computed == len(prompt) + MAX_NEW - 1
    assert outputs["policy"].generated_tokens == peft_greedy(model, "policy", prompt)


def test_replacing_an_adapter_fifty_times_leaves_no_drift(fp32_pair):
    """50 consecutive replacements of one adapter, then tokens equal a fresh merge of the last one."""
    base, model = fp32_pair
    engine = make_engine(copy.deepcopy(base))
    modules = from_peft_model(model, "policy")
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        last = {
            name: LoraModule(
                pair.lora_A + 0.01 * torch.randn(pair.lora_A.shape, generator=generator), pair.lora_B, pair.scaling
            )
            for name, pair in modules.items()
        }
        engine.load_adapter("policy", last)
    assert engine.policy_version == 50 and engine.runner.adapters.refs["policy"].version == 50
    merged = reference_copy(base)
    with torch.no_grad():
        for name, pair in last.items():
            merged.get_submodule(name).weight.add_(pair.scaling * pair.lora_B @ pair.lora_A)
    prompts = make_prompts(3, 8, 20, seed=9)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=MAX_NEW, adapter="policy")
    outputs = run_to_completion(engine)
    for index, prompt in enumerate(prompts):
        expected = merged.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False
        )[0, len(prompt) :]
        assert outputs[str(index)].generated_tokens == expected.tolist(), index


def test_bad_adapters_are_refused_whole_and_the_old_one_keeps_serving(fp32_pair):
    base, model = fp32_pair
    engine = served_engine(base, model, max_loras=2, max_lora_rank=8)
    good = from_peft_model(model, "policy")
    name = next(iter(good))
    wrong_rank = {**good, name: LoraModule(good[name].lora_A[:2], good[name].lora_B, 2.0)}
    cases = {
        "unknown module": ({"model.layers.0.nope": good[name]}, "model.layers.0.nope.lora_A"),
        "wrong shape": (wrong_rank, f"{name}.lora_B"),
        "output head": ({"lm_head": good[name]}, "lm_head.lora_A"),
    }
    before = engine.policy_version
    for case, (modules, field) in cases.items():
        with pytest.raises(FieldError) as error:
            engine.load_adapter("policy", modules)
        assert error.value.field == field, case
    high_rank = {name: LoraModule(torch.zeros(16, 64), torch.zeros(good[name].lora_B.shape[0], 16), 1.0)}
    with pytest.raises(FieldError, match="max_lora_rank") as error:
        engine.load_adapter("policy", high_rank)
    with pytest.raises(FieldError) as error:
        engine.load_adapter("third", good)
    assert error.value.field == "max_loras" and "--max-loras" in str(error.value)  # and the ways out
    assert "/v1/unload_lora_adapter" in str(error.value) and "push under one of those names" in str(error.value)
    nan = {**good, name: LoraModule(good[name].lora_A * float("nan"), good[name].lora_B, 2.0)}
    with pytest.raises(FieldError) as error:
        engine.load_adapter("policy", nan, check_finite=True)
    assert error.value.field == f"{name}.lora_A"
    with pytest.raises(FieldError) as error:
        engine.add_request("x", [1, 2, 3], GREEDY, adapter="missing")
    assert error.value.field == "adapter"
    assert engine.policy_version == before
    prompt = make_prompts(1, 10, 10, seed=10)[0]
    engine.add_request("still", prompt, GREEDY, max_new_tokens=MAX_NEW, adapter="policy")
    assert run_to_completion(engine)["still"].generated_tokens == peft_greedy(model, "policy", prompt)


def test_closing_removes_the_hooks(fp32_pair):
    """After close the served model computes exactly the base forward again (no hook left behind)."""
    base, model = fp32_pair
    served = copy.deepcopy(base)
    engine = make_engine(served)
    engine.load_adapter("policy", from_peft_model(model, "policy"))
    engine.close()
    ids = torch.tensor([make_prompts(1, 10, 10, seed=12)[0]])
    with torch.inference_mode():
        assert torch.equal(served(ids).logits, base(ids).logits)


def test_bf16_unmerged_serving_is_closer_to_peft_than_merged_weights():
    """bf16, an update about 1% of the weights (a few training steps): log-probs of sampled tokens against peft's
    own bf16 forward (fp32 adapter weights, peft's default), served unmerged and as merged bf16 weights (today's
    merged push). The base model's bf16 path is the same in both; merging rounds the update into bf16 weights, so
    unmerged serving is closer. Mean and p99 |delta| are printed."""
    base, model = peft_model(torch.bfloat16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.02)
    model.set_adapter("policy")
    merged = copy.deepcopy(model).merge_and_unload(adapter_names=["policy"])
    unmerged = make_engine(copy.deepcopy(base))
    unmerged.load_adapter("policy", from_peft_model(model, "policy"))
    prompts = make_prompts(8, 20, 20, seed=20)
    deltas = {}
    for label, engine, adapter in (("unmerged", unmerged, "policy"), ("merged", make_engine(merged), None)):
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, SAMPLED, max_new_tokens=32, adapter=adapter)
        outputs = run_to_completion(engine)
        rows = [("policy", prompt, outputs[str(index)].generated_tokens) for index, prompt in enumerate(prompts)]
        expected = torch.cat(peft_logprobs(model, rows))
        got = torch.cat([torch.tensor(outputs[str(index)].logprobs) for index in range(len(prompts))])
        deltas[label] = (got - expected).abs()
    for label, delta in deltas.items():
        print(f"bf16 {label}: mean |delta| {delta.mean():.2e}, p99 {delta.quantile(0.99):.2e}")
    assert deltas["unmerged"].mean() < deltas["merged"].mean()
    assert deltas["unmerged"].quantile(0.99) < deltas["merged"].quantile(0.99)


def test_generate_batch_serves_a_peft_models_adapters_side_by_side(fp32_pair):
    """`generate_batch(peft_model, prompts, adapter=[...])`: one name per prompt (None: the base), in one batch;
    each equals peft's generate, and the PeftModel is left as it was (its active adapter, no hook)."""
    _, model = fp32_pair
    model.set_adapter("policy")
    prompts = make_prompts(3, 6, 20, seed=13)
    adapters = ["other", None, "policy"]
    outputs = generate_batch(
        model, prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, adapter=adapters, progress_bar=False
    )
    for index, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        assert outputs[f"req_{index}"].generated_tokens == peft_greedy(model, adapter, prompt), adapter
    model.set_adapter("policy")
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        before = model(ids).logits
    generate_batch(model, prompts[:1], max_new_tokens=2, sampling=GREEDY, adapter="other", progress_bar=False)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(FieldError) as error:
        generate_batch(model.get_base_model(), prompts[:1], max_new_tokens=2, adapter="other", progress_bar=False)
    assert error.value.field == "adapter"


def test_a_peft_directory_served_from_the_start_matches_peft(tmp_path, fp32_pair):
    """`rollout-worker --lora NAME=PATH`'s path: an adapter saved by peft (rank_pattern / alpha_pattern and rsLoRA
    scalings read from its config) and served from the start equals peft's generate of the model that saved it."""
    base, model = fp32_pair
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"up_proj": 4},
        alpha_pattern={"v_proj": 4},
        use_rslora=True,
        init_lora_weights=False,
    )
    torch.manual_seed(21)
    saved = get_peft_model(reference_copy(base), config, adapter_name="patterned").eval()
    saved.save_pretrained(tmp_path)
    engine = make_engine(copy.deepcopy(base))
    engine.serve_adapter_from_start("patterned", load_peft_dir(str(tmp_path / "patterned")))
    assert engine.policy_version == 0 and engine.runner.adapters.refs["patterned"].version == 0
    prompt = make_prompts(1, 12, 12, seed=22)[0]
    engine.add_request("x", prompt, GREEDY, max_new_tokens=MAX_NEW, adapter="patterned")
    assert run_to_completion(engine)["x"].generated_tokens == peft_greedy(saved, "patterned", prompt)
    with pytest.raises(FieldError) as error:
        load_peft_dir(str(tmp_path / "missing"))
    assert error.value.field == "lora"


def test_an_adapter_directory_whose_files_are_not_regular_or_too_large_is_refused_unread(tmp_path):
    """A FIFO in place of the adapter's weights blocked peft's reader for good, inside safetensors' native code that
    holds Python's lock: the whole worker froze (its HTTP and ZeroMQ loops with it). A sparse config of gigabytes was
    read and decoded whole. Both are refused by name before peft opens anything (the FIFO in a subprocess: the old
    reader would hang the test's own process)."""
    import subprocess
    import sys

    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    (fifo_dir / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    os.mkfifo(fifo_dir / "adapter_model.safetensors")
    script = (
        "import sys\nfrom rollout.config import FieldError\nfrom rollout.engine.lora.adapter_weights import load_peft_dir\n"
        "try:\n    load_peft_dir(sys.argv[1])\nexcept FieldError as error:\n    print(error.field, error.reason)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(fifo_dir)], capture_output=True, text=True, timeout=90)
    assert done.stdout.startswith("lora ") and "adapter_model.safetensors" in done.stdout, done.stdout + done.stderr
    assert "not a regular file" in done.stdout

    huge_dir = tmp_path / "huge"
    huge_dir.mkdir()
    with open(huge_dir / "adapter_config.json", "wb") as config:
        config.truncate(2 << 30)  # sparse: 2 GiB read as zeros
    with pytest.raises(FieldError) as refused:
        load_peft_dir(str(huge_dir))
    assert refused.value.field == "lora" and "adapter_config.json" in refused.value.reason
    assert "at most 1048576" in refused.value.reason

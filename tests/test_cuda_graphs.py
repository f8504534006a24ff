"""The decode-graph path: persistent, padded input buffers and the scratch block that takes padding rows.

On CPU the graphs are not captured (that needs CUDA): `enable_decode_graphs(..., capture=False)` runs the same
forward eagerly over the same persistent buffers, so these tests check everything but the capture itself against
transformers' `generate`. Capture and replay, also after a weight update, are tested in tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_parity import GREEDY, reference_greedy  # noqa: E402

from conftest import make_engine, make_prompts, needs_triton_interpreter, reference_copy, run_to_completion, tiny_model  # noqa: E402
from rollout.config import ContinuousBatchingConfig, FieldError  # noqa: E402
from rollout.engine.attention.kernel_plan import plan_splits  # noqa: E402
from rollout.engine.runner.cuda_graphs import decode_buckets  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64, 100, 256, 1000])
def test_buckets_cover_every_batch_size_with_bounded_padding(max_num_seqs):
    buckets = decode_buckets(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_num_seqs
    for batch in range(1, max_num_seqs + 1):
        bucket = next(size for size in buckets if size >= batch)
        assert bucket < 2 * batch, (batch, bucket)  # padding under half the bucket


# max_model_len 256: 16 blocks per sequence, so the graphs' static plan splits each decode over 2 key slices (and
# merges them) instead of the 16 a 2048-token context gets; on CPU every slice is a Triton interpreter program.
ENGINE = {
    "num_blocks": 96,
    "block_size": 16,
    "max_batch_tokens": 64,
    "attention_backend": "triton",
    "max_model_len": 256,
}


def graph_engine(model, **config):
    config = {**ENGINE, **config}
    engine = make_engine(model, **config)
    max_blocks = config["max_model_len"] // config["block_size"]
    assert plan_splits(8, model.config.num_key_value_heads, max_blocks) == 2  # the split-and-merge path runs
    graphs = engine.runner.enable_decode_graphs(
        engine.config.max_num_seqs, engine.max_model_len, capture=DEVICE.type == "cuda"
    )
    replays = []
    run = graphs.run
    graphs.run = lambda *args: replays.append(len(args[0])) or run(*args)  # count the steps the graphs serve
    return engine, replays


# gemma2: sliding windows and soft-capping; with overlapped scheduling, so each step's input ids reach the graph's
# buffer from the previous step's tokens on the device.
@needs_triton_interpreter
@pytest.mark.parametrize("kind, overlap", [("qwen3", False), ("gemma2", True)])
def test_graph_decode_matches_generate(kind, overlap):
    """Seven sequences of different lengths and budgets, three more arriving mid-run into a cache too small to avoid
    reusing finished sequences' blocks: decode batches grow and shrink across buckets, so rows that held a sequence
    become padding while its blocks serve a newcomer. Greedy tokens equal generate's, which they would not if a
    padding or stale row wrote into a live sequence's cache."""
    model = tiny_model(kind).to(DEVICE)
    reference = reference_copy(model)
    prompts = make_prompts(10, 5, 40, seed=3)
    budgets = [9, 6, 4, 2, 3, 7, 5, 8, 3, 6]  # the first owns block 0, the first block handed out
    # max_batch_tokens: all of a wave in one step.
    engine, replays = graph_engine(model, num_blocks=24, max_batch_tokens=512, overlap_scheduling=overlap)
    for index in range(7):
        engine.add_request(str(index), prompts[index], GREEDY, max_new_tokens=budgets[index])
    outputs = {}
    for step in range(200):
        if step == 4:
            for index in range(7, 10):
                engine.add_request(str(index), prompts[index], GREEDY, max_new_tokens=budgets[index])
        outputs.update({o.request_id: o for o in engine.step() if o.is_finished})
        if step > 4 and not engine.has_unfinished():
            break
    for index, (prompt, budget) in enumerate(zip(prompts, budgets)):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, budget), index
    assert 7 in replays and 1 in replays and len(set(replays)) >= 4, replays  # shrinking batches, several buckets
    engine.close()


def test_padding_rows_point_at_the_scratch_block():
    """After a batch of 7 (bucket 8) then one of 3 (bucket 4), row 3 is padding again: token 0 at position 0,
    writing the scratch slot, with the scratch block first in its block table; the plan covers the bucket."""
    from rollout.engine.kv.kv_cache import KVCacheShape, PagedKVCache
    from rollout.engine.runner.cuda_graphs import DecodeGraphs

    cache = PagedKVCache(KVCacheShape(1, 2, 16), num_blocks=20, block_size=16, dtype=torch.float32, device=DEVICE)
    seen = []

    def forward(input_ids, positions, metadata, keep):
        seen.append((input_ids.clone(), positions.clone(), metadata.slot_mapping.clone(), metadata.triton_plan))
        return torch.zeros(input_ids.shape[1], 5)

    graphs = DecodeGraphs(forward, cache, max_batch=16, max_blocks_per_seq=8, heads_per_kv=2, capture=False)
    tables = torch.arange(7 * 3).view(7, 3)
    graphs.run(list(range(1, 8)), [20 + i for i in range(7)], tables)
    logits = graphs.run([5, 6, 7], [30, 31, 32], tables[:3])
    assert logits.shape == (3, 5)
    input_ids, positions, slots, attention_plan = seen[-1]
    assert input_ids.tolist() == [[5, 6, 7, 0]] and positions.tolist() == [[30, 31, 32, 0]]
    # Each new token's slot: its block (position // 16 in its table) * 16 + position % 16.
    expected = [int(tables[row, position // 16]) * 16 + position % 16 for row, position in enumerate([30, 31, 32])]
    assert slots.tolist() == [*expected, cache.scratch_slot]
    assert attention_plan.block_table[3, 0] == cache.scratch_block
    assert attention_plan.block_table[:3, :3].tolist() == tables[:3].tolist()
    assert attention_plan.context.tolist() == [30, 31, 32, 0]
    assert attention_plan.query_start.tolist() == [0, 1, 2, 3, 4] and attention_plan.tile_seq.tolist() == [0, 1, 2, 3]


@needs_triton_interpreter
def test_graph_decode_with_groups_and_sampling_equals_eager():
    """Sampled groups (forked samples share blocks, copy-on-write of the last one) decode to the same tokens and
    logprobs through the graph path as through the eager path (randomness is keyed per sample and position)."""
    from rollout.config import SamplingParams

    prompts = make_prompts(2, 10, 30, seed=8)
    budgets = [6, 3]  # 6 samples (bucket 8), then 3 (bucket 4): padding rows in both
    sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=11, stop_token_ids=())
    results = []
    for use_graphs in (False, True):
        model = tiny_model("qwen3").to(DEVICE)
        if use_graphs:
            engine, replays = graph_engine(model)
        else:  # eager on a GPU too, where graphs are the default
            engine = make_engine(model, **ENGINE, use_cuda_graph=False)
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, sampling, n=3, max_new_tokens=budgets[index])
        outputs = run_to_completion(engine)
        results.append({k: (v.generated_tokens, v.logprobs) for k, v in outputs.items()})
        engine.close()
    assert replays and max(replays) == 6 and 3 in replays
    assert results[0].keys() == results[1].keys()
    for key, (tokens, logprobs) in results[0].items():
        assert results[1][key][0] == tokens, key
        assert torch.allclose(torch.tensor(results[1][key][1]), torch.tensor(logprobs), atol=1e-5), key


def test_scratch_block_is_outside_the_managed_cache():
    """The block manager hands out blocks [0, num_blocks); the cache has one more, the scratch block."""
    engine = make_engine(tiny_model("qwen3"), num_blocks=10, block_size=16)
    assert engine.block_manager.num_blocks == 10 and engine.kv_cache.scratch_block == 10
    assert engine.kv_cache.kv.shape[2] == 11 and engine.kv_cache.scratch_slot == 10 * 16
    engine.close()


def test_graphs_need_the_triton_kernels():
    engine = make_engine(tiny_model("qwen3"), block_size=16, attention_backend="torch")
    with pytest.raises(FieldError) as raised:
        engine.runner.enable_decode_graphs(8, 256)
    assert raised.value.field == "use_cuda_graph"
    engine.close()


def test_compile_settings_are_validated():
    from transformers import CompileConfig

    with pytest.raises(FieldError, match="decode_compile_config"):
        ContinuousBatchingConfig(decode_compile_config={"mode": "default"})
    # transformers' default mode captures graphs itself: refused unless our graphs are off.
    with pytest.raises(FieldError, match="reduce-overhead"):
        ContinuousBatchingConfig(decode_compile_config=CompileConfig())
    ContinuousBatchingConfig(decode_compile_config=CompileConfig(), use_cuda_graph=False)
    with pytest.raises(FieldError, match="use_cuda_graph"):
        ContinuousBatchingConfig(use_cuda_graph="yes")


def test_compiled_decode_matches_generate():
    """decode_compile_config compiles the decode forward (here with a backend that records what dynamo traced and
    runs it as is: no C++ compiler needed): greedy tokens still equal generate's."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompts = make_prompts(3, 5, 20, seed=4)
    graph_inputs: list[torch.Tensor] = []

    def recording_backend(graph_module, example_inputs, **kwargs):  # what dynamo hands a compiler
        graph_inputs.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        return graph_module.forward

    compile_config = CompileConfig(backend=recording_backend, mode=None, dynamic=True)
    engine = make_engine(model, attention_backend="torch", decode_compile_config=compile_config)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=6)
    outputs = run_to_completion(engine)
    assert graph_inputs, "dynamo should have traced the decode forward"
    # The paged attention (cache write included) is never traced: functionalising the in-place write of a cache
    # that is a graph input would copy the whole cache every step.
    cache_storage = engine.kv_cache.kv.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != cache_storage for t in graph_inputs)
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, 6), index
    engine.close()


@needs_triton_interpreter
def test_graph_decode_serves_adapters_side_by_side():
    """The base, a LoRA adapter on every Linear and one that also trains the input embeddings and the output head
    whole (modules_to_save) decode in the same graph steps; each equals peft's generate. Replacing an adapter in
    place keeps the graphs; a slot's first saved modules (new hooks) make them captured again."""
    from peft import LoraConfig, get_peft_model

    from rollout.engine.lora.adapter_weights import SavedModule, from_peft_model

    base = tiny_model("qwen3").to(DEVICE)
    torch.manual_seed(2)
    saving = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], modules_to_save=["embed_tokens", "lm_head"]
    )
    # "plain" first: added after the head is wrapped, all-linear would also take the head's frozen original.
    peft = get_peft_model(reference_copy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), "plain")
    peft.add_adapter("saving", saving)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    peft.eval()
    engine, replays = graph_engine(base)
    released = []
    release = engine.runner.decode_graphs.release
    engine.runner.decode_graphs.release = lambda: released.append(1) or release()
    plain = from_peft_model(peft, "plain")
    engine.load_adapter("plain", plain)
    saving_modules = from_peft_model(peft, "saving")
    lora_only = {name: weights for name, weights in saving_modules.items() if not isinstance(weights, SavedModule)}
    engine.load_adapter("saving", lora_only)
    prompts = make_prompts(3, 6, 20, seed=4)
    adapters = [None, "plain", "saving"]

    def decode_all(tag: str, budget: int) -> dict:
        for index, (prompt, adapter) in enumerate(zip(prompts, adapters)):
            engine.add_request(f"{tag}{index}", prompt, GREEDY, max_new_tokens=budget, adapter=adapter)
        return run_to_completion(engine)

    decode_all("warm", 2)  # the graphs of these buckets exist now, with every LoRA hook
    count = len(released)
    engine.load_adapter("plain", plain)  # in place: the same hooks and slots
    assert len(released) == count
    engine.load_adapter("saving", saving_modules)  # the embeddings' and the head's hooks and copies are new
    outputs = decode_all("x", 5)
    assert len(released) == count + 1 and replays
    for index, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        ids = torch.tensor([prompt], device=DEVICE)
        kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
        if adapter is None:
            with peft.disable_adapter():
                expected = peft.generate(input_ids=ids, **kwargs)
        else:
            peft.set_adapter(adapter)
            expected = peft.generate(input_ids=ids, **kwargs)
        assert outputs[f"x{index}"].generated_tokens == expected[0, len(prompt) :].tolist(), adapter
    engine.close()


@needs_triton_interpreter
def test_graph_decode_records_moe_routes():
    """An MoE model's decode steps through the graph path record each token's routes (the graphs are captured
    again once the route hooks arrive); they equal the router choices transformers reports for the same tokens."""
    import numpy as np

    from rollout.config import SamplingParams

    model = tiny_model("qwen3_moe").to(DEVICE)
    reference = reference_copy(model)
    engine, replays = graph_engine(model)
    routed = SamplingParams(do_sample=False, stop_token_ids=(), return_routes=True)
    prompts = make_prompts(3, 6, 20, seed=5)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, routed if index else GREEDY, max_new_tokens=5)
    outputs = run_to_completion(engine)
    assert replays
    for index, prompt in enumerate(prompts[1:], start=1):
        output = outputs[str(index)]
        tokens = torch.tensor([prompt + output.generated_tokens[:-1]], device=DEVICE)
        with torch.no_grad():
            logits = reference(input_ids=tokens, output_router_logits=True).router_logits
        expected = torch.stack([layer.topk(2, -1).indices for layer in logits], 1).cpu().numpy()
        assert np.array_equal(output.routes, expected[len(prompt) - 1 :])
        assert np.array_equal(output.prompt_routes, expected[: len(prompt) - 1])
    engine.close()

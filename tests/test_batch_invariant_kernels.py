"""The GPU halves of `rollout.invariant`'s attention and row reductions (`triton_attention.py`, `triton_rows.py`), run
in Triton's interpreter on the CPU: each row's result is the same bits whatever else is in the call (other rows, left
padding with its start, the engine's unpadded layout), close to PyTorch's own arithmetic; the batch-invariant mode
routes a CUDA tensor's last-axis mean and log_softmax to them; the engine and the trainer through all of them agree
bit for bit; and the kernels compile for sm_90 and sm_80."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import compile_for_gpus, needs_triton_interpreter
from rollout.invariant import reductions
from rollout.invariant.attention import KEY_BLOCK, QUERY_TILE, attend_in_torch
from rollout.invariant.triton_attention import attend_invariant_triton
from rollout.invariant.triton_rows import row_log_softmax, row_mean


@needs_triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_reductions_give_a_row_the_same_bits_whatever_the_others(dtype):
    torch.manual_seed(0)
    x = (torch.randn(70, 2500) * 4).to(dtype)  # rows longer than one 1024-column block
    for count in (2, 33, 70):
        assert torch.equal(row_mean(x[:count])[:1], row_mean(x[:1]))
        assert torch.equal(row_log_softmax(torch.cat([x[1:count], x[:1]]))[-1:], row_log_softmax(x[:1]))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(row_mean(x).float(), x.float().mean(-1), atol=tolerance, rtol=tolerance)
    expected = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(row_log_softmax(x).float(), expected, atol=tolerance * 4, rtol=tolerance)
    assert row_log_softmax(x).dtype == dtype and row_mean(x[:0]).shape == (0,)


def _causal(queries: int, keys: int) -> torch.Tensor:
    return torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]


@needs_triton_interpreter
@pytest.mark.parametrize("head_dim", [32, 40], ids=["dim32", "dim40"])
def test_attention_kernel_gives_a_sequence_the_same_bits_padded_or_alone(head_dim):
    """A 70-token sequence attended alone (the engine's layout: keys from 0, start None) and left-padded by 9 in a
    batch with a longer sequence (TRL's layout, start 9): the same bits, close to the PyTorch version; GQA 4 -> 2."""
    torch.manual_seed(1)
    heads, kv_heads, length, pad = 4, 2, 70, 9
    q, k, v = (torch.randn(1, n, length, head_dim) for n in (heads, kv_heads, kv_heads))
    alone_allowed = _causal(length, length)[None, None]
    alone = attend_invariant_triton(q, k, v, alone_allowed, None, head_dim**-0.5, None, QUERY_TILE, KEY_BLOCK)

    other_q, other_k, other_v = (torch.randn(1, n, length + pad, head_dim) for n in (heads, kv_heads, kv_heads))
    batch_q, batch_k, batch_v = (
        torch.cat([torch.nn.functional.pad(t, (0, 0, pad, 0)), o])
        for t, o in ((q, other_q), (k, other_k), (v, other_v))
    )
    allowed = _causal(length + pad, length + pad)[None, None].repeat(2, 1, 1, 1)
    allowed[0, :, :, :pad] = False  # the left padding is seen by nobody
    start = torch.tensor([pad, 0])
    batch = attend_invariant_triton(
        batch_q, batch_k, batch_v, allowed, start, head_dim**-0.5, None, QUERY_TILE, KEY_BLOCK
    )
    assert torch.equal(batch[:1, :, pad:], alone)
    reference = attend_in_torch(q, k, v, alone_allowed, None, head_dim**-0.5)
    torch.testing.assert_close(alone, reference, atol=1e-5, rtol=1e-5)
    # Decoding the last token alone against the same keys: its row again.
    last = attend_invariant_triton(
        q[:, :, -1:], k, v, alone_allowed[:, :, -1:], None, head_dim**-0.5, None, QUERY_TILE, KEY_BLOCK
    )
    assert torch.equal(last, alone[:, :, -1:])


@needs_triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_paged_call_reads_a_cache_in_place_with_the_dense_calls_bits(dtype):
    """The engine's call (`attend_invariant_paged_triton`: each sequence's blocks read where they lie in a paged
    cache, in shuffled order, GQA 4 -> 2) gives the bits of the trainer's call over the same keys gathered into a
    dense batch; NaN planted in every slot no query sees (past each sequence's end, a previous owner's, and the
    padding blocks) changes nothing."""
    from rollout.invariant.triton_attention import attend_invariant_paged_triton

    torch.manual_seed(2)
    block_size, heads, kv_heads, head_dim, queries = 16, 4, 2, 32, 5
    lengths = [70, 23]
    key_cache, value_cache = (torch.randn(12, block_size, kv_heads, head_dim).to(dtype) for _ in range(2))
    order = torch.randperm(11)
    table = torch.full((2, 5), 11)  # block 11 pads a short sequence's table
    table[0], table[1, :2] = order[:5], order[5:7]
    allowed = torch.zeros(2, 1, queries, 5 * block_size, dtype=torch.bool)
    for row, length in enumerate(lengths):
        for query in range(queries):
            allowed[row, 0, query, : length - queries + query + 1] = True
        for cache in (key_cache, value_cache):  # what no query sees: NaN
            cache.view(-1, kv_heads, head_dim)[(table[row, :, None] * block_size + torch.arange(block_size)).flatten()[
                length:
            ]] = float("nan")  # fmt: skip
    query = torch.randn(2, heads, queries, head_dim).to(dtype)
    scaling = head_dim**-0.5
    ends = torch.tensor(lengths)  # each row walks its own keys only (the blocks after add exactly 0)
    paged = attend_invariant_paged_triton(
        query, key_cache, value_cache, table, allowed, ends, scaling, None, QUERY_TILE, KEY_BLOCK
    )
    dense_key, dense_value = (
        c[table].nan_to_num(0.0).flatten(1, 2).transpose(1, 2) for c in (key_cache, value_cache)
    )  # (2, kv_heads, 80, head_dim)
    dense = attend_invariant_triton(query, dense_key, dense_value, allowed, None, scaling, None, QUERY_TILE, KEY_BLOCK)
    assert not paged.isnan().any() and torch.equal(paged, dense)
    reference = attend_in_torch(query.float(), dense_key.float(), dense_value.float(), allowed, None, scaling)
    torch.testing.assert_close(paged.float(), reference, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


@needs_triton_interpreter
def test_the_mode_routes_a_cuda_tensors_last_axis_reductions_to_the_kernels(monkeypatch):
    """`invariant_reduction` (what the batch-invariant mode calls) with CPU tensors standing in for CUDA ones: a
    last-axis mean / log_softmax, however spelled, takes the kernels; another axis or a dtype argument does not."""
    monkeypatch.setattr(reductions, "on_kernel_device", lambda x: True)
    x = torch.randn(5, 3, 1100, requires_grad=True)
    cases = [
        (torch.mean, (x, -1), {"keepdim": True}, row_mean(x.detach()).unsqueeze(-1)),
        (torch.Tensor.mean, (x, [2]), {}, row_mean(x.detach())),
        (torch.nn.functional.log_softmax, (x,), {"dim": -1}, row_log_softmax(x.detach())),
        (torch.log_softmax, (x, 2), {}, row_log_softmax(x.detach())),
    ]
    for func, args, kwargs, expected in cases:
        got = reductions.invariant_reduction(func, args, kwargs)
        assert torch.equal(got.detach(), expected), func
    for func, args, kwargs in [
        (torch.mean, (x, 0), {}),
        (torch.Tensor.mean, (x,), {}),
        (torch.log_softmax, (x, -1, torch.float64), {}),
        (torch.nn.functional.log_softmax, (x, -1, 3, torch.float64), {}),
        (torch.sum, (x, -1), {}),
        (torch.mean, (x.detach(), -1), {"out": torch.empty(5, 3)}),  # torch writes into `out`
        (torch.mean, (torch.tensor(2.0), -1), {}),  # a 0-d tensor
        (torch.log_softmax, (torch.zeros(3, 0), -1), {}),  # an empty last axis
    ]:
        assert reductions.invariant_reduction(func, args, kwargs) is None, (func, args)
    # The backward is the ordinary one.
    reductions.invariant_log_softmax(x).logsumexp(-1).sum().backward()
    expected_grad = torch.autograd.grad(torch.log_softmax(x, -1).logsumexp(-1).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected_grad, atol=1e-5, rtol=1e-4)


COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout.invariant import triton_attention as ta, triton_rows as tr
results = []
for dtype in ("bf16", "fp32"):
    pointers = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "table_ptr": "i64", "allowed_ptr": "u8",
                "start_ptr": "i64", "end_ptr": "i64", "out_ptr": dtype}
    constants = {"QUERY_TILE": 16, "KEY_BLOCK": 64, "HEAD_DIM": 128, "HAS_SOFTCAP": True, "IN_ORDER": False}
    kinds = {**{name: "*" + kind for name, kind in pointers.items()}, "scaling": "fp32", "softcap": "fp32",
             **{name: "constexpr" for name in constants}}
    signature = {name: kinds.get(name, "i64") for name in ta.invariant_attention_kernel.arg_names}
    rows = {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "columns": "i64", "stride_row": "i64",
            "BLOCK": "constexpr"}
    softmax = dict(rows, stride_out="i64")
    for arch in (90, 80):
        for name, kernel, sig, const, warps in (
            ("attention", ta.invariant_attention_kernel, signature, constants, ta.NUM_WARPS),
            ("mean", tr.row_mean_kernel, rows, {"BLOCK": tr.BLOCK}, tr.NUM_WARPS),
            ("log_softmax", tr.row_log_softmax_kernel, softmax, {"BLOCK": tr.BLOCK}, tr.NUM_WARPS),
        ):
            compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": warps, "enable_fp_fusion": False})
            results.append([name, dtype, arch, compiled.metadata.shared, "cubin" in compiled.asm])
print(json.dumps(results))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's ptxas ships for Linux")
def test_the_kernels_compile_for_hopper_and_ampere(tmp_path):
    results = compile_for_gpus(COMPILE, tmp_path)
    assert len(results) == 12
    for name, dtype, arch, shared, has_cubin in results:
        assert has_cubin and shared <= 232448, (name, dtype, arch, shared)


class _LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](...)` records the arguments under the current phase, then runs
    the kernel."""

    def __init__(self, kernel, phase: list[str]):
        self.kernel, self.phase, self.launches = kernel, phase, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.phase[0], args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _cuda_specialization(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton's launcher would compile this call as on an sm_90 GPU (its own binder: argument types, which
    integers are constants or divisible by 16, which pointers aligned): two calls with one specialization run one
    compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    options = {name: kernel.kwargs.get(name) for name in ("do_not_specialize", "do_not_specialize_on_alignment")}
    compiled = JITFunction(kernel.fn, **options)
    binder = create_function_from_signature(compiled.signature, compiled.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    return tuple(map(tuple, binder(*args, **kwargs)[1]))


@needs_triton_interpreter
@pytest.mark.timeout(300)
@pytest.mark.parametrize("graphs", [False, True, "drafts"], ids=["eager", "decode-graphs", "speculative"])
def test_the_engine_and_the_trainer_agree_bit_for_bit_through_the_gpu_kernels(monkeypatch, graphs):
    """The GPU's arithmetic on a CPU: with `KERNELS_ON_CPU` every invariant matmul, reduction and attention runs as
    its Triton kernel (in the interpreter); a bf16 engine's sampled log-probs (chunked prefill, shared prompts, two
    key blocks) still equal the trainer's invariant forward over TRL's padded layout, bit for bit, with its decode
    steps eager or through the decode graphs' persistent, padded buffers (run eagerly here: capture needs CUDA).
    And on a GPU they would run the same compiled kernels: Triton's launcher specializes the engine's launches
    (decode steps of one query, its paged cache read in place) as it does the trainer's (a padded batch), which the
    interpreter's arithmetic cannot show (a decode's kernel once summed a key block's weights in another order on
    an H200). Speculative decoding's drafted steps (suffix drafts of a repeating prompt, verified eagerly beside the
    decode graphs: a batch-invariant engine has no verify graphs) keep the same bits and kernels."""
    import copy

    from transformers import AutoModelForCausalLM, Qwen3Config

    from conftest import run_to_completion
    from rollout import ContinuousBatchingConfig, SamplingParams
    from rollout.benchmarks.throughput.fidelity import padded_batch_logprobs, scale_to_entropy
    from rollout.engine.engine import Engine
    from rollout.invariant import triton_attention, triton_matmul, triton_rows
    from trainer_bridge import batch_invariant

    monkeypatch.setattr(reductions, "KERNELS_ON_CPU", True)
    phase = ["engine"]
    recorders = {}
    for module, name in [
        (triton_attention, "invariant_attention_kernel"),
        (triton_matmul, "invariant_matmul_kernel"),
        (triton_rows, "row_mean_kernel"),
        (triton_rows, "row_log_softmax_kernel"),
    ]:
        recorders[name] = _LaunchRecorder(getattr(module, name), phase)
        monkeypatch.setattr(module, name, recorders[name])
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    scale_to_entropy(model, [list(range(3, 40))])
    trainer = copy.deepcopy(model)
    drafting = dict(speculative="suffix", num_speculative_tokens=3) if graphs == "drafts" else {}
    settings = ContinuousBatchingConfig(batch_invariant=True, num_blocks=64, max_batch_tokens=32, **drafting)
    engine = Engine(model, settings)
    replays, drafted = [], []
    if graphs:
        decode_graphs = engine.runner.enable_decode_graphs(4, engine.max_model_len, capture=False)
        run = decode_graphs.run
        monkeypatch.setattr(decode_graphs, "run", lambda *a, **k: replays.append(len(a[0])) or run(*a, **k))
    if graphs == "drafts":
        from rollout.engine.speculative import drafter

        monkeypatch.setattr(drafter, "MIN_ACCEPTANCE", 0.0)  # draft whatever matches: every verification path runs
        assert engine.runner.verify_graphs is None
        step = engine.runner.run
        monkeypatch.setattr(engine.runner, "run", lambda b, *a: drafted.append(b.num_draft_tokens) or step(b, *a))
    # With drafts, two rounds of one prompt: the second drafts from the first round's samples.
    outputs = {}
    for round_, lengths in enumerate([(66,), (66,)] if graphs == "drafts" else [(30, 66)]):
        for index, length in enumerate(lengths):
            prompt = [(7 * j + (length > 30)) % 128 for j in range(length)]
            sampling = SamplingParams(temperature=1.0, seed=index + 10 * round_)
            engine.add_request(f"r{round_}-{index}", prompt, sampling, n=3, max_new_tokens=4)
        outputs.update(run_to_completion(engine))
    engine.close()
    samples = [(list(o.prompt_ids), list(o.generated_tokens), torch.tensor(o.logprobs)) for o in outputs.values()]
    assert len(samples) == 6 and max(len(p) + len(c) for p, c, _ in samples) > KEY_BLOCK
    if graphs == "drafts":
        assert max(drafted) > 0, "no step verified drafts"
    else:  # Through the graphs: decode steps of 3 sequences, each padded to the bucket of 4 with a padding sequence.
        assert replays == ([3, 3, 3] if graphs else [])
    phase[0] = "trainer"
    with batch_invariant(trainer):
        reference = padded_batch_logprobs(trainer, [p for p, _, _ in samples], [c for _, c, _ in samples], batch_size=4)
        for (_, _, ours), theirs in zip(samples, reference):
            assert torch.equal(ours, theirs)
    for name, recorder in recorders.items():
        compiled = {"engine": set(), "trainer": set()}
        for who, args, kwargs in recorder.launches:
            compiled[who].add(_cuda_specialization(recorder.kernel, args, kwargs))
        assert compiled["engine"] and compiled["engine"] == compiled["trainer"], (name, compiled)
        if name != "invariant_matmul_kernel":  # one kernel per dtype (the matmul: one per layer shape)
            assert len(compiled["engine"]) == 1, (name, compiled)
    attention = recorders["invariant_attention_kernel"]
    calls = [dict(zip(attention.kernel.arg_names, args)) for who, args, _ in attention.launches if who == "engine"]
    assert calls and all(call["block_size"] < KEY_BLOCK for call in calls)  # the engine read its cache in place


@needs_triton_interpreter
def test_an_invariant_engines_graphs_leave_adapters_and_moe_models_to_eager_steps(monkeypatch):
    """A batch-invariant engine's decode graphs hold no LoRA hook (its adapters' steps run eagerly): with an adapter
    loaded, a base-only request's steps never switch the hooks on (their per-step routing reads slots back to the
    host), and its tokens and log-probs are the adapter-free engine's. An MoE model's eager experts read their
    routing back to the host, which no graph can hold: asking graphs of an invariant MoE engine is refused by name."""
    import copy

    from peft import LoraConfig, get_peft_model

    from conftest import make_engine, run_to_completion, tiny_model
    from rollout import SamplingParams
    from rollout.config import FieldError
    from rollout.engine.lora import layers
    from rollout.engine.lora.adapter_weights import from_peft_model

    monkeypatch.setattr(reductions, "KERNELS_ON_CPU", True)  # the cache laid out as on a GPU: graphs can serve
    base = tiny_model("llama")
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj"]), adapter_name="a")
    acted = []
    rows_by_slot = layers.LoraStepState.rows_by_slot
    monkeypatch.setattr(layers.LoraStepState, "rows_by_slot", lambda *a: acted.append(1) or rows_by_slot(*a))
    results = []
    for with_adapter in (True, False):
        engine = make_engine(copy.deepcopy(base), batch_invariant=True, block_size=16)
        engine.runner.enable_decode_graphs(2, engine.max_model_len, capture=False)
        if with_adapter:
            engine.load_adapter("a", from_peft_model(peft, "a"))
        engine.add_request("base", [1, 2, 3, 4, 5], SamplingParams(temperature=1.0, seed=1), max_new_tokens=6)
        (output,) = run_to_completion(engine).values()
        engine.close()
        results.append((list(output.generated_tokens), torch.tensor(output.logprobs)))
    assert acted == []
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])

    moe = make_engine(tiny_model("qwen3_moe"), batch_invariant=True, block_size=16)
    with pytest.raises(FieldError, match="use_cuda_graph.*MoE"):
        moe.runner.enable_decode_graphs(2, moe.max_model_len, capture=False)
    moe.close()

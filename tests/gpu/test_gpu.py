"""GPU tests (`pytest -m gpu tests/gpu`): bf16 parity of the engine on the Triton kernels with transformers'
`generate`, and the fp32 logits option. Skipped without CUDA; CI machines have none, so these run on a lent GPU.
The kernels themselves are tested against a PyTorch reference by tests/test_triton_attention.py, which runs them
compiled on CUDA when it is available (in Triton's interpreter otherwise)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def small_qwen3(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.2,  # sharper distributions: fewer bf16 near-ties between the top two tokens
    )
    return AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()


def test_bf16_greedy_agrees_with_generate_on_the_triton_kernels():
    """bf16 changes rounding with the kernel's summation order, so a greedy path may flip at a near-tie and then
    diverge for good; what must hold is that most tokens agree before any divergence. Threshold: on average at
    least 90% of each completion equals generate's before the first difference (random-weight models with sharp
    logits rarely have ties; an attention bug makes completions diverge at once)."""
    from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch

    model = small_qwen3(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (int(n),), generator=generator).tolist() for n in (17, 64, 130, 300, 33, 90)]
    max_new = 48
    config = ContinuousBatchingConfig(num_blocks=512, block_size=16, attention_backend="triton")
    outputs = generate_batch(
        model,
        prompts,
        sampling=SamplingParams(do_sample=False, stop_token_ids=()),
        max_new_tokens=max_new,
        continuous_batching_config=config,
        progress_bar=False,
    )
    agreement = []
    for index, prompt in enumerate(prompts):
        expected = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )[0, len(prompt) :].tolist()
        got = outputs[f"req_{index}"].generated_tokens
        same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), max_new)
        agreement.append(same / max_new)
    assert sum(agreement) / len(agreement) >= 0.9, agreement


def test_bf16_logprobs_close_to_teacher_forced():
    """Rollout logprobs of a bf16 model vs the same model's teacher-forced forward: mean |delta| <= 2e-3 (the
    nano figure's goal), with the projection in fp32 on both sides."""
    from rollout.benchmarks.details import teacher_forced_logprobs
    from rollout.config import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import Engine

    model = small_qwen3(torch.bfloat16)
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=256, fp32_logits=True))
    prompts = [[int(t) for t in torch.randint(0, 4096, (n,))] for n in (40, 120)]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=32))
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    engine.close()
    deltas = torch.cat(
        [
            (
                torch.tensor(outputs[str(i)].logprobs)
                - teacher_forced_logprobs(model, p, outputs[str(i)].generated_tokens, True)
            ).abs()
            for i, p in enumerate(prompts)
        ]
    )
    assert deltas.mean().item() <= 2e-3, deltas.mean().item()


def _spy_replays(engine) -> list[int]:
    """Batch sizes of the decode steps the CUDA graphs served."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "use_cuda_graph should be on by default on CUDA"
    replays: list[int] = []
    run = graphs.run
    graphs.run = lambda *args: replays.append(len(args[0])) or run(*args)
    return replays


def test_decode_graphs_replay_after_a_weight_update():
    """fp32 (exact comparisons: no TF32, IEEE dots in the kernel): warmup() captures every bucket; greedy decoding
    through the replayed graphs equals generate; after an in-place weight update the same graphs, not captured
    again, decode with the new weights (equal to generate of the new model, different from the old)."""
    from rollout.config import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import Engine

    old_model = small_qwen3(torch.float32)
    old_copy = copy.deepcopy(old_model)  # the engine's model gets the new weights
    new_model = small_qwen3(torch.float32)
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    engine = Engine(old_model, ContinuousBatchingConfig(num_blocks=256, max_num_seqs=16))
    engine.warmup()
    graphs = engine.runner.decode_graphs
    assert graphs.captured == graphs.buckets and graphs.disabled_reason is None
    replays = _spy_replays(engine)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (int(n),), generator=generator).tolist() for n in (20, 75, 140)]
    greedy = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=12)

    def run(tag: str) -> list[list[int]]:
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{tag}{index}", prompt, greedy)
        outputs = {}
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.is_finished})
        return [outputs[f"{tag}{index}"].generated_tokens for index in range(len(prompts))]

    def reference(model) -> list[list[int]]:
        return [
            model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]

    before = run("a")
    engine.update_weights({name: tensor.clone() for name, tensor in new_model.state_dict().items()})
    after = run("b")
    engine.close()
    old_reference = reference(old_copy)
    assert before == old_reference
    assert after == reference(new_model) != old_reference
    assert 3 in replays and graphs.captured == graphs.buckets  # replayed, never captured again


def test_graph_and_eager_decode_agree_in_bf16():
    """bf16 through the graphs vs eager decoding: padding to the bucket changes matmul shapes, hence rounding, so
    the same near-tie threshold as the generate parity test applies (90% of each completion before any flip); up
    to the first differing token both saw the same context, so their logprobs may differ only by rounding (bf16
    keeps about 3 significant digits; a corrupted cache row would move them by far more than 2e-2 on average)."""
    from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch

    model = small_qwen3(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4096, (int(n),), generator=generator).tolist() for n in (30, 60, 90, 200, 45)]
    sampling = SamplingParams(do_sample=False, stop_token_ids=())
    results = []
    for use_graphs in (False, True):
        config = ContinuousBatchingConfig(num_blocks=512, use_cuda_graph=use_graphs)
        outputs = generate_batch(
            model, prompts, sampling=sampling, max_new_tokens=40, continuous_batching_config=config, progress_bar=False
        )
        results.append([outputs[f"req_{i}"] for i in range(len(prompts))])
    agreement, deltas = [], []
    for eager, graph in zip(*results):
        same = next((i for i, (a, b) in enumerate(zip(eager.generated_tokens, graph.generated_tokens)) if a != b), 40)
        agreement.append(same / 40)
        deltas += [abs(a - b) for a, b in zip(eager.logprobs[: same + 1], graph.logprobs[: same + 1])]
    assert sum(agreement) / len(agreement) >= 0.9, agreement
    assert sum(deltas) / len(deltas) <= 2e-2, sum(deltas) / len(deltas)


def test_a_failed_capture_falls_back_to_eager_on_the_default_stream():
    """A forward that synchronises with the host cannot be captured: the engine warns, decodes eagerly and
    correctly, and leaves the thread on the stream it was on (torch.cuda.graph does not restore it on failure)."""
    from rollout.config import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import Engine

    model = small_qwen3(torch.float32)
    reference = copy.deepcopy(model)
    layer = model.model.layers[0]

    def host_sync(module, args):
        float(args[0].sum())  # reads a device value on the host: not capturable

    handle = layer.register_forward_pre_hook(host_sync)
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=128, max_num_seqs=4))
    engine.warmup()
    graphs = engine.runner.decode_graphs
    assert graphs.disabled_reason is not None and not graphs.captured
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    prompt = list(range(5, 40))
    engine.add_request("a", prompt, SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=8))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.is_finished})
    engine.close()
    handle.remove()
    expected = reference.generate(
        torch.tensor([prompt], device="cuda"), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(prompt) :].tolist()
    assert outputs["a"].generated_tokens == expected


def test_overlapped_steps_never_wait_for_the_device():
    """With overlap on (the CUDA default), queueing a step (inputs, graph replay or forward, every sampling
    processor, log-probs) makes no host synchronisation: CUDA's sync detector is set to raise around each launch.
    fp32 and no stop tokens, so overlap and sequential steps run the same batches: their outputs are identical."""
    from rollout.config import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import Engine

    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 4096, (int(n),), generator=generator).tolist() for n in (25, 80, 150, 40, 60)]
    samplings = [
        SamplingParams(do_sample=False, stop_token_ids=(), top_logprobs=3),
        SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1, stop_token_ids=()),
        SamplingParams(
            do_sample=True, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.1, seed=2, stop_token_ids=()
        ),
        SamplingParams(do_sample=True, presence_penalty=0.3, logprob_mode="raw", seed=3, stop_token_ids=()),
        SamplingParams(
            do_sample=True,
            typical_p=0.8,
            epsilon_cutoff=0.001,
            eta_cutoff=0.002,
            no_repeat_ngram_size=1,
            bad_words_ids=((5,), (9, 11)),
            suppress_tokens=(7,),
            begin_suppress_tokens=(8,),
            logprob_mode="temperature_scaled",
            seed=4,
            stop_token_ids=(),
        ),  # fmt: skip
    ]
    results = []
    for overlap in (False, True):
        engine = Engine(
            small_qwen3(torch.float32), ContinuousBatchingConfig(num_blocks=256, overlap_scheduling=overlap)
        )
        assert engine.overlap_scheduling is overlap
        engine.warmup()
        launch = engine._launch
        launches = []

        def watched(*args, _launch=launch, _launches=launches):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _launch(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                _launches.append(1)

        if overlap:
            engine._launch = watched
        for index, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            engine.add_request(str(index), prompt, sampling, n=2, max_new_tokens=16)
        outputs = {}
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.is_finished})
        engine.close()
        assert not overlap or len(launches) > 10
        results.append({k: (o.generated_tokens, o.logprobs, o.finish_reason) for k, o in outputs.items()})
    assert results[0].keys() == results[1].keys()
    for key, (tokens, logprobs, reason) in results[0].items():
        assert results[1][key][0] == tokens and results[1][key][2] == reason, key
        assert torch.allclose(torch.tensor(results[1][key][1]), torch.tensor(logprobs), atol=1e-5), key

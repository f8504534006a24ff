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


def argmax_gaps(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """At every generated position, the largest logit minus the chosen token's logit, from one teacher-forced
    forward of `model` over prompt + tokens: 0 where the token is the reference's greedy choice."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device="cuda").unsqueeze(1))[:, 0]
    return (logits.max(1).values - chosen).cpu()


def eager_attention_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights under transformers' eager attention: its distance from the default (sdpa) forward is the
    bf16 noise floor of the reference itself."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager


def assert_within_the_noise_floor(model, prompts, completions, floor_completions) -> None:
    """Greedy parity in bf16. A greedy path flips at a near-tie and then diverges for good, and transformers' own
    eager and sdpa attention already disagree that way (on this model they share under half of each completion), so
    token equality with generate cannot be the test. What must hold is that every token the engine chose is a
    near-argmax of the reference's teacher-forced logits on the engine's own sequence, no farther from it than
    transformers' eager attention is (largest gap, and share of positions that are not the argmax); an attention
    bug picks tokens several logits below the top at most positions."""
    gaps = torch.cat([argmax_gaps(model, p, c) for p, c in zip(prompts, completions)])
    floor = torch.cat([argmax_gaps(model, p, c) for p, c in zip(prompts, floor_completions)])
    assert gaps.max() <= 2 * max(floor.max().item(), 0.125), (gaps.max().item(), floor.max().item())
    missed, floor_missed = (gaps > 0).float().mean().item(), (floor > 0).float().mean().item()
    assert missed <= min(2 * floor_missed + 0.01, 0.5), (missed, floor_missed)  # never vacuous


def greedy_reference(model, prompts, max_new) -> list[list[int]]:
    return [
        model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
        )[0, len(prompt) :].tolist()
        for prompt in prompts
    ]


def test_bf16_greedy_agrees_with_generate_on_the_triton_kernels():
    """bf16 greedy completions on the Triton kernels are as close to generate's forward as transformers' own eager
    attention is (see assert_within_the_noise_floor)."""
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
    completions = [outputs[f"req_{index}"].generated_tokens for index in range(len(prompts))]
    floor = greedy_reference(eager_attention_copy(model), prompts, max_new)
    assert_within_the_noise_floor(model, prompts, completions, floor)


def test_bf16_logprobs_close_to_teacher_forced():
    """Rollout logprobs of a bf16 model (projection in fp32, as TRL's cast_lm_head_to_fp32) vs the same model's
    teacher-forced forward: the mean |delta| is at most 1.5x what transformers' own eager attention gives against
    that forward on the same tokens (the bf16 floor: about 0.04 on this sharp random model; the nano workload's
    report figure has its own goal). The floor is above what the fp32 projection itself changes (about 0.01 here),
    so the projection is pinned apart, exactly, by test_sampling.py::test_fp32_logits_computes_the_projection_in_fp32."""
    from rollout.benchmarks.throughput.fidelity import teacher_forced_logprobs
    from rollout.config import ContinuousBatchingConfig, SamplingParams
    from rollout.engine.engine import Engine

    model = small_qwen3(torch.bfloat16)
    eager = eager_attention_copy(model)
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
    deltas, floor = [], []
    for index, prompt in enumerate(prompts):
        tokens = outputs[str(index)].generated_tokens
        reference = teacher_forced_logprobs(model, prompt, tokens, True)
        deltas.append((torch.tensor(outputs[str(index)].logprobs) - reference).abs())
        floor.append((teacher_forced_logprobs(eager, prompt, tokens, True) - reference).abs())
    mean, floor_mean = torch.cat(deltas).mean().item(), torch.cat(floor).mean().item()
    assert mean <= 1.5 * max(floor_mean, 1e-3), (mean, floor_mean)


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
    each may flip at a near-tie; both must stay within the noise floor of generate's forward (see
    assert_within_the_noise_floor), and up to the first differing token, where both saw the same context, their
    logprobs differ by rounding only: on average by at most 1.5x what transformers' eager attention gives against
    the default forward on the same tokens, and by at most 0.05 (measured on an H100: 0.037 between the two paths,
    floor about 0.04)."""
    from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
    from rollout.benchmarks.throughput.fidelity import teacher_forced_logprobs

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
    eager_attention = eager_attention_copy(model)
    floor = greedy_reference(eager_attention, prompts, 40)
    for outputs in results:
        assert_within_the_noise_floor(model, prompts, [o.generated_tokens for o in outputs], floor)
    deltas, floor_deltas = [], []
    for prompt, eager, graph in zip(prompts, *results):
        same = next((i for i, (a, b) in enumerate(zip(eager.generated_tokens, graph.generated_tokens)) if a != b), 40)
        deltas += [abs(a - b) for a, b in zip(eager.logprobs[: same + 1], graph.logprobs[: same + 1])]
        tokens = eager.generated_tokens
        reference = teacher_forced_logprobs(model, prompt, tokens)
        floor_deltas += (teacher_forced_logprobs(eager_attention, prompt, tokens) - reference).abs().tolist()
    mean, floor_mean = sum(deltas) / len(deltas), sum(floor_deltas) / len(floor_deltas)
    assert mean <= min(1.5 * max(floor_mean, 1e-3), 0.05), (mean, floor_mean)


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
        launch = engine.loop._launch
        launches = []

        def watched(*args, _launch=launch, _launches=launches):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _launch(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                _launches.append(1)

        if overlap:
            engine.loop._launch = watched
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


def test_colocated_sleep_returns_the_cache_and_graphs_come_back():
    """ColocatedEngine on CUDA: sleep() lowers torch.cuda.memory_allocated by at least the KV cache's bytes; the
    next round wakes the cache, keeps its decode graphs when the cache came back where it was and captures them again
    when it moved (they read the cache's address), and generates the same greedy tokens as before the sleep, on the
    trainer's own fp32 model, which comes back in training mode."""
    from rollout import ContinuousBatchingConfig, SamplingParams
    from trainer_bridge import ColocatedEngine, PromptGroup

    model = small_qwen3(torch.float32).train()
    greedy = SamplingParams(do_sample=False, max_new_tokens=24, stop_token_ids=())
    groups = [PromptGroup([5 + i, 17, 300 + i, 9], 2, greedy) for i in range(4)]
    with ColocatedEngine(model, ContinuousBatchingConfig(num_blocks=512)) as engine:
        first = [[c.token_ids for c in r.completions] for r in engine.generate(groups)]
        graphs = engine.engine.runner.decode_graphs
        assert graphs is not None and graphs.captured  # decode ran through captured graphs
        cache_bytes, address = engine.kv_cache_bytes, engine.engine.kv_cache.kv.data_ptr()
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        engine.sleep()
        torch.cuda.synchronize()
        assert awake - torch.cuda.memory_allocated() >= cache_bytes
        again = [[c.token_ids for c in r.completions] for r in engine.generate(groups)]
        assert again == first and graphs.captured
        moved = engine.engine.kv_cache.kv.data_ptr() != address
        assert engine.graph_releases == int(moved)
        assert model.training


def test_a_gpu_workers_shm_update_stages_into_a_page_locked_buffer_of_its_own():
    """Over shm a GPU worker copies each bucket out of the shared segment into its own host buffer, page-locked
    (`is_pinned`: the commit's copy to the model goes at the bus's speed); bytes from a CUDA tensor written into the
    segment land there and go to the GPU unchanged."""
    from rollout.protocol.staging import StagingPool
    from rollout.protocol.transports.shm import ShmReceiver

    pool = StagingPool(keep=False, pin_device=torch.device("cuda", torch.cuda.current_device()))
    host, (segment, view) = ShmReceiver(torch.device("cuda")).staging(pool, 1 << 24)
    assert host.is_pinned() and not view.is_pinned()
    source = torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, device="cuda")
    view.copy_(source)  # what a trainer on this GPU does (`ShmSender.stage`)
    host.copy_(view)  # what each bucket's job does (`StagedUpdate.copy_from_segment`)
    back = torch.empty_like(source).copy_(host, non_blocking=True)  # what the commit does
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    pool.give_back(host, (segment, view))
    del segment, view


def test_the_shm_sender_stages_a_gpus_bytes_through_its_pinned_buffer():
    """A trainer's bucket of CUDA bytes lands in the worker's segment at the staging layout's offsets (through the
    sender's page-locked bounce buffer), and the host bytes it returns for the checksum are those bytes."""
    from types import SimpleNamespace

    from rollout.protocol.staging import StagingPool, staging_layout
    from rollout.protocol.transports.shm import ShmSender
    from rollout.protocol.weight_messages import TensorSpec, WeightsReady

    specs = [TensorSpec("a", "uint8", [1000]), TensorSpec("b", "uint8", [3000])]
    offsets, total = staging_layout(specs)
    pool = StagingPool(keep=False, pin_device=torch.device("cuda", torch.cuda.current_device()))
    segment, view = pool.shared(total)
    link = SimpleNamespace(index=0, transport="shm")
    sender = ShmSender(SimpleNamespace(links=[link]))
    sender.attach(link, WeightsReady("u", total, segment.name), specs)
    a = torch.randint(0, 256, (1000,), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (3000,), dtype=torch.uint8, device="cuda")
    placed = sender.stage([(0, 0, a), (1, 0, b[:1200]), (1, 1200, b[1200:])], offsets)
    assert [piece.numel() for piece in placed] == [1000, 1200, 1800]
    assert torch.equal(view[offsets[0] : offsets[0] + 1000], a.cpu())
    assert torch.equal(view[offsets[1] : offsets[1] + 3000], b.cpu())
    assert torch.equal(torch.cat(placed), torch.cat([a, b]).cpu())
    del placed
    sender.close()
    pool.give_back(None, (segment, view))

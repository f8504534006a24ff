"""MoE routes recorded during rollout (`SamplingParams(return_routes=True)`) and replayed in the trainer
(`trainer_bridge.route_replay`), on a tiny Qwen3-MoE with its head scaled to a realistic entropy.

References: the router choices transformers itself reports for a teacher-forced forward of the same tokens
(`output_router_logits=True`, top-k of each layer's router logits), and the rollout's own fp32 log-probs, which a
replayed forward must reproduce (and a forward with altered routes must not)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import FieldError, SamplingParams
from trainer_bridge.route_replay import routes_for, routing_replay

TOP_K = 2
SAMPLED = SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(), seed=5)
ROUTED = SAMPLED.merged(return_routes=True)


@pytest.fixture(scope="module")
def moe():
    model = tiny_model("qwen3_moe", seed=3)
    scale_to_entropy(model, make_prompts(4, 20, 40, seed=1))
    return model


@torch.inference_mode()
def reference_routes(model, tokens: list[int]) -> np.ndarray:
    """(len(tokens), layers, top_k): each position's experts as transformers reports them (its router logits)."""
    output = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    return torch.stack([logits.topk(TOP_K, -1).indices for logits in output.router_logits], 1).numpy()


def check_against_reference(model, output) -> None:
    tokens = output.prompt_ids + output.generated_tokens
    expected = reference_routes(model, tokens[:-1])  # the last token was never run through the model
    prompt_len = len(output.prompt_ids)
    assert output.prompt_routes.shape == (prompt_len - 1, 2, TOP_K)
    assert output.routes.shape == (len(output.generated_tokens), 2, TOP_K)
    assert np.array_equal(output.prompt_routes, expected[: prompt_len - 1]), output.request_id
    assert np.array_equal(output.routes, expected[prompt_len - 1 :]), output.request_id


def test_recorded_routes_equal_transformers_router_choices(moe):
    """Chunked prefill (a 16-token budget), a group of 3 forked samples, a request without routes in the same
    steps."""
    engine = make_engine(copy.deepcopy(moe), max_batch_tokens=16)
    prompts = make_prompts(3, 10, 30, seed=2)
    engine.add_request("group", prompts[0], ROUTED, max_new_tokens=8, n=3)
    engine.add_request("single", prompts[1], ROUTED, max_new_tokens=6)
    engine.add_request("plain", prompts[2], SAMPLED, max_new_tokens=6)
    outputs = run_to_completion(engine)
    reference = reference_copy(moe)
    for request_id in ("group#0", "group#1", "group#2", "single"):
        check_against_reference(reference, outputs[request_id])
    assert outputs["plain"].routes is None and outputs["plain"].prompt_routes is None
    engine.close()


def test_streamed_and_preempted_requests_keep_their_routes(moe):
    """A cache too small for all of them at once: requests are preempted and recomputed; streamed deltas carry
    each new token's routes, and they add up to the whole."""
    engine = make_engine(copy.deepcopy(moe), num_blocks=14, block_size=4, max_batch_tokens=32)
    prompts = make_prompts(4, 8, 14, seed=4)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, ROUTED, max_new_tokens=10, streaming=True)
    pieces: dict[str, list] = {}
    prompt_routes = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.prompt_routes is not None:
                prompt_routes[output.request_id] = output.prompt_routes
            if output.generated_tokens:
                pieces.setdefault(output.request_id, []).append((output.generated_tokens, output.routes))
    assert engine.scheduler.num_preemptions > 0, "the cache was large enough: nothing was recomputed"
    reference = reference_copy(moe)
    for index, prompt in enumerate(prompts):
        request_id = f"r{index}"
        tokens = [token for chunk, _ in pieces[request_id] for token in chunk]
        whole = type("Whole", (), {})()
        whole.request_id, whole.prompt_ids, whole.generated_tokens = request_id, prompt, tokens
        whole.prompt_routes = prompt_routes[request_id]
        whole.routes = np.concatenate([routes for _, routes in pieces[request_id]])
        check_against_reference(reference, whole)
    engine.close()


@torch.inference_mode()
def logprobs_of(model, completions, routes=None) -> list[torch.Tensor]:
    """Teacher-forced fp32 log-probs of each completion's tokens, one right-padded batch, replaying `routes`."""
    length = max(len(c.prompt_ids) + len(c.generated_tokens) for c in completions)
    ids = torch.zeros(len(completions), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, completion in enumerate(completions):
        tokens = completion.prompt_ids + completion.generated_tokens
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    context = routing_replay(model, routes) if routes is not None else torch.no_grad()
    with context:
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    result = []
    for row, completion in enumerate(completions):
        start = len(completion.prompt_ids) - 1
        positions = torch.arange(start, start + len(completion.generated_tokens))
        log_probs = torch.log_softmax(logits[row, positions], -1)
        result.append(log_probs.gather(1, torch.tensor(completion.generated_tokens).unsqueeze(1)).squeeze(1))
    return result


def test_replayed_routes_reproduce_the_rollout_logprobs_and_altered_ones_do_not(moe):
    engine = make_engine(copy.deepcopy(moe))
    prompts = make_prompts(3, 8, 20, seed=6)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, ROUTED, max_new_tokens=8)
    outputs = run_to_completion(engine)
    engine.close()
    completions = [outputs[f"r{index}"] for index in range(3)]
    routes = routes_for(completions)
    assert routes.shape[:2] == (3, max(len(c.prompt_ids) + len(c.generated_tokens) for c in completions))
    trainer = reference_copy(moe)
    for completion, replayed in zip(completions, logprobs_of(trainer, completions, routes)):
        assert torch.allclose(replayed, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)
    altered = routes.clone()
    altered[altered >= 0] = (altered[altered >= 0] + 1) % 4  # every token to other experts
    changed = logprobs_of(trainer, completions, altered)
    assert max(float((c - torch.tensor(o.logprobs)).abs().max()) for c, o in zip(changed, completions)) > 1e-2


def test_bad_routes_and_dense_models_are_refused_by_name(moe):
    from transformers import CompileConfig

    dense = make_engine(tiny_model("qwen3"))
    compiled = make_engine(
        copy.deepcopy(moe), decode_compile_config=CompileConfig(mode="default"), use_cuda_graph=False
    )
    for engine, reason in ((dense, "no MoE router"), (compiled, "torch.compile")):
        with pytest.raises(FieldError, match=reason) as error:
            engine.add_request("x", [1, 2, 3], ROUTED, max_new_tokens=2)
        assert error.value.field == "return_routes"
        engine.close()
    trainer = reference_copy(moe)
    ids = torch.tensor([[1, 2, 3, 4]])
    for routes, message in (
        (torch.zeros(1, 4, 3, TOP_K, dtype=torch.long), "layers"),
        (torch.zeros(1, 4, 2, 3, dtype=torch.long), "top_k"),
        (torch.arange(TOP_K).expand(1, 5, 2, TOP_K), "tokens"),
        (torch.arange(TOP_K).expand(2, 2, 2, TOP_K), r"\(2, 2\) tokens"),  # as many tokens, another batch shape
        (torch.zeros(1, 4, 2, TOP_K), "integer"),
        (torch.ones(1, 4, 2, TOP_K, dtype=torch.bool), "integer"),  # experts 0/1 as True/False: not ids
        # one id given, the other -1: the router decided the whole token, dropping the given id silently
        (torch.tensor([0, -1]).expand(1, 4, 2, TOP_K), "some expert ids -1"),
    ):
        with pytest.raises(ValueError, match=message), routing_replay(trainer, routes), torch.no_grad():
            trainer(input_ids=ids)
    with pytest.raises(ValueError, match="MoE"):
        with routing_replay(tiny_model("qwen3"), torch.zeros(1, 4, 2, TOP_K, dtype=torch.long)):
            pass


def test_bf16_replay_turns_differing_routes_into_none():
    """bf16: the rollout (paged attention, packed chunks) and the trainer's padded forward pick different experts for
    some (token, layer) decisions; replayed, the experts the trainer's forward runs (what transformers' experts
    module receives) are the rollout's everywhere. The policy: the routing benchmark's Qwen3-MoE (64 experts, 8 per
    token: near-ties between the 8th and 9th expert are common, as in real MoE policies; head at 1.5 nats; bf16)."""
    from rollout.benchmarks.grpo.routing_replay import moe_policy

    model = moe_policy("qwen3_moe", seed=3)
    engine = make_engine(copy.deepcopy(model), max_batch_tokens=64)
    prompts = make_prompts(8, 20, 60, seed=2)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, ROUTED, max_new_tokens=32)
    outputs = run_to_completion(engine)
    engine.close()
    completions = [outputs[f"r{index}"] for index in range(len(prompts))]
    routes = routes_for(completions)
    batch, length = routes.shape[:2]
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row, completion in enumerate(completions):
        tokens = completion.prompt_ids + completion.generated_tokens
        ids[row, : len(tokens)] = torch.tensor(tokens)
    mask = (routes[..., 0, 0] >= 0).long()
    mask[torch.arange(batch), mask.sum(1)] = 1  # each sequence's last token (no routes of its own)
    trainer = reference_copy(model)
    used = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda module, args: used.append(args[1].view(batch, length, -1)))
        for layer in trainer.model.layers
    ]

    def differing() -> float:
        experts = torch.stack(used[-2:], 2)  # (batch, length, layers, top_k)
        differ = (experts.sort(-1).values != routes.sort(-1).values).any(-1)
        return float(differ[routes[..., 0, 0] >= 0].float().mean())

    with torch.no_grad():
        trainer(input_ids=ids, attention_mask=mask)
        before = differing()
        with routing_replay(trainer, routes):
            trainer(input_ids=ids, attention_mask=mask)
        after = differing()
    for hook in hooks:
        hook.remove()
    print(f"differing (token, layer) decisions: {before:.4f} -> {after:.4f} replayed")
    assert before > 0, "no routing decision differed in bf16: the setup does not reproduce the problem"
    assert after == 0


def test_prefix_cached_blocks_keep_the_routes_they_were_computed_with(moe):
    """A second request sharing a 24-token prefix takes the first one's cached blocks (no recompute) and its routes
    for them, equal to transformers' router choices; blocks computed without routes are not taken."""
    shared = make_prompts(1, 24, 24, seed=9)[0]
    engine = make_engine(copy.deepcopy(moe), block_size=4)
    engine.add_request("plain", shared + [7, 8], SAMPLED, max_new_tokens=3)
    run_to_completion(engine)
    engine.add_request("again", shared + [6], SAMPLED, max_new_tokens=3)  # a plain request takes them
    run_to_completion(engine)
    hits = engine.block_manager.num_prefix_tokens_hit
    assert hits == 24
    engine.add_request("routed", shared + [9], ROUTED, max_new_tokens=3)  # their routes are unknown: recomputed
    reference = reference_copy(moe)
    check_against_reference(reference, run_to_completion(engine)["routed"])
    assert engine.block_manager.num_prefix_tokens_hit == hits
    # The recomputed blocks now stand under the prefix's hashes, with their routes: the next requests for routes
    # take them (each had computed the whole prefix again while the plain blocks stayed cached), plain ones too.
    for request_id, sampling in (("routed again", ROUTED), ("plain again", SAMPLED)):
        engine.add_request(request_id, shared + [5], sampling, max_new_tokens=3)
        output = run_to_completion(engine)[request_id]
        assert engine.block_manager.num_prefix_tokens_hit == hits + 24, request_id
        hits = engine.block_manager.num_prefix_tokens_hit
        if sampling is ROUTED:
            check_against_reference(reference, output)
    engine.close()
    engine = make_engine(copy.deepcopy(moe), block_size=4)
    engine.add_request("first", shared + [1, 2, 3], ROUTED, max_new_tokens=4)
    first = run_to_completion(engine)["first"]
    computed = engine.counters.computed_tokens
    engine.add_request("second", shared + [4, 5], ROUTED, max_new_tokens=4)
    second = run_to_completion(engine)["second"]
    assert engine.block_manager.num_prefix_tokens_hit == 24  # six cached blocks taken
    assert engine.counters.computed_tokens - computed < len(shared)
    reference = reference_copy(moe)
    for output in (first, second):
        check_against_reference(reference, output)
    assert np.array_equal(second.prompt_routes[:24], first.prompt_routes[:24])
    engine.close()


def test_across_a_keep_update_each_tokens_routes_go_with_its_version(moe):
    """A weight update in "keep" mode mid-generation: the rows sampled before it carry the old weights' routes, the
    rows after it the new weights' over the old KV, as transformers computes them (the old model's forward with its
    cache, then the new model's forward continuing from that cache)."""
    engine = make_engine(copy.deepcopy(moe))
    prompt = make_prompts(1, 12, 12, seed=12)[0]
    engine.add_request("r", prompt, ROUTED, max_new_tokens=10)
    for _ in range(4):  # the prompt and a few tokens under version 0
        engine.step()
    new_model = tiny_model("qwen3_moe", seed=4)
    scale_to_entropy(new_model, make_prompts(4, 20, 40, seed=1))
    engine.update_weights(new_model.state_dict(), version=1, mode="keep")
    output = run_to_completion(engine)["r"]
    engine.close()
    versions = output.policy_versions  # [[0, 0], [1, first token sampled by the new weights]]
    assert [version for version, _ in versions] == [0, 1]
    switch = len(prompt) - 1 + versions[1][1]  # first position the new weights computed
    tokens = torch.tensor([prompt + output.generated_tokens[:-1]])
    with torch.inference_mode():
        before = reference_copy(moe)(input_ids=tokens[:, :switch], use_cache=True, output_router_logits=True)
        after = reference_copy(new_model)(
            input_ids=tokens[:, switch:], past_key_values=before.past_key_values, output_router_logits=True
        )
    expected = np.concatenate(
        [torch.stack([r.topk(TOP_K, -1).indices for r in out.router_logits], 1).numpy() for out in (before, after)]
    )
    assert np.array_equal(output.prompt_routes, expected[: len(prompt) - 1])
    assert np.array_equal(output.routes, expected[len(prompt) - 1 :])


def test_a_replay_that_raises_inside_a_recorded_router_leaves_no_mode_behind(moe):
    """The engine's recorder and a trainer's replay tap the same routers (colocated): a forward that raises inside
    a router (routes of the wrong length) leaves torch's mode stack as it was, and the engine records as before."""
    from torch.overrides import _get_current_function_mode_stack

    engine = make_engine(copy.deepcopy(moe))
    prompt = make_prompts(1, 9, 9, seed=13)[0]
    engine.add_request("a", prompt, ROUTED, max_new_tokens=3)
    run_to_completion(engine)
    model = engine.runner.model
    with (
        pytest.raises(ValueError, match="tokens"),
        routing_replay(model, torch.arange(TOP_K).expand(1, 5, 2, TOP_K)),
    ):
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    assert _get_current_function_mode_stack() == []
    engine.add_request("b", prompt, ROUTED, max_new_tokens=3)
    check_against_reference(reference_copy(moe), run_to_completion(engine)["b"])
    engine.close()


def test_generate_batch_refuses_routes_it_cannot_record_before_its_warm_up(moe, monkeypatch):
    """generate_batch on a compiled decode forward: return_routes is refused before the warm-up compiles (about
    25 s on a CPU), not after it."""
    from transformers import CompileConfig

    from rollout import ContinuousBatchingConfig, generate_batch
    from rollout.engine.engine import Engine

    def no_warm_up(self, num_tokens=8):
        raise AssertionError("the warm-up ran before the refusal")

    monkeypatch.setattr(Engine, "warmup", no_warm_up)
    config = ContinuousBatchingConfig(num_blocks=64, decode_compile_config=CompileConfig(mode="default"))
    for sampling in (ROUTED, {"return_routes": True}):
        with pytest.raises(FieldError, match="torch.compile") as error:
            generate_batch(copy.deepcopy(moe), [[1, 2, 3]], sampling=sampling, max_new_tokens=2, progress_bar=False,
                           continuous_batching_config=config)  # fmt: skip
        assert error.value.field == "return_routes"


def test_route_rows_keep_what_each_sample_used_and_bad_wire_routes_are_refused():
    """A leader that recomputes its prompt after forking rewrites its own copy (its forks keep the routes of the KV
    they used); a swapped-out request offers no block; a worker's routes that do not fit the message are refused."""
    from rollout.engine.requests.route_rows import RouteCache, RouteRows
    from rollout.protocol import messages as p
    from rollout.protocol.reply_frames import pack_routes, unpack_message

    leader = type("Request", (), {})()
    leader.routes = RouteRows(4, leader)
    leader.routes.write(0, np.full((4, 2, 2), 1, dtype=np.int16))
    fork = type("Request", (), {})()
    fork.routes = leader.routes.forked(fork)
    leader.routes.write(0, np.full((4, 2, 2), 2, dtype=np.int16))  # the leader recomputed (preemption)
    assert (fork.routes.prompt_routes() == 1).all() and (leader.routes.prompt_routes() == 2).all()
    leader.block_hashes, leader.block_ids = [11], []  # swapped out: its blocks are on the host
    RouteCache(4, 8).keep(leader, {11: 3})  # nothing to offer, no error
    frames: list[bytes] = []
    completion = p.Completion(0, [1, 2, 3], [0.0] * 3, "length")
    completion.routes = pack_routes(np.zeros((2, 2, 2), dtype=np.int16), frames)  # 2 rows for 3 tokens
    with pytest.raises(ValueError, match="2 rows for 3 tokens"):
        unpack_message(p.GroupResult("g", [1, 2], [completion]), frames)


def test_samples_recomputed_onto_cached_blocks_report_those_blocks_routes(moe):
    """A "recompute" weight update: both samples of a group recompute their KV under the new weights, the second
    taking the first's new cached blocks; every sample's routes are the new weights' (transformers' router choices
    of the new model), none left from before the update."""
    new_model = tiny_model("qwen3_moe", seed=4)
    scale_to_entropy(new_model, make_prompts(4, 20, 40, seed=1))
    engine = make_engine(copy.deepcopy(moe), block_size=4, max_batch_tokens=16)
    prompt = make_prompts(1, 18, 18, seed=9)[0]
    engine.add_request("g", prompt, ROUTED, max_new_tokens=12, n=2)
    for _ in range(6):
        engine.step()
    hits = engine.block_manager.num_prefix_tokens_hit
    engine.update_weights(new_model.state_dict(), version=1, mode="recompute")
    outputs = run_to_completion(engine)
    assert engine.block_manager.num_prefix_tokens_hit > hits  # the second recompute took cached blocks
    reference = reference_copy(new_model)
    for request_id in ("g#0", "g#1"):
        check_against_reference(reference, outputs[request_id])
    engine.close()


def test_routes_of_a_router_that_does_not_choose_by_topk_are_refused_by_name():
    """PhiMoE's router picks experts with its sparsemixer, never torch.topk: its routes were all zeros and replay
    changed nothing. Both are refused, naming the router."""
    from transformers import AutoModelForCausalLM, PhimoeConfig

    from rollout import generate_batch

    config = PhimoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=TOP_K,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(FieldError, match="return_routes: PhimoeTopKRouter chooses its experts without torch.topk"):
        generate_batch(model, [[5, 6, 7]], sampling=ROUTED, max_new_tokens=2)
    with pytest.raises(ValueError, match="PhimoeTopKRouter chooses its experts without torch.topk"):
        with routing_replay(model, torch.zeros(1, 3, 2, TOP_K, dtype=torch.long)):
            pass


def test_replay_under_torch_compile_routes_every_forward_by_its_own_routes(moe):
    """A compiled model (dynamo; the eager backend keeps it quick) replays the routes given to each forward: a
    first forward's routes are not baked into the next ones (they were: later routes and no routes alike)."""
    model = reference_copy(moe)
    ids = torch.tensor([[5, 9, 17, 33, 65, 129]])
    generator = torch.Generator().manual_seed(0)
    first, second = (
        torch.stack([torch.randperm(4, generator=generator)[:TOP_K] for _ in range(6 * 2)]).reshape(1, 6, 2, TOP_K)
        for _ in range(2)
    )
    with torch.no_grad():
        natural = model(input_ids=ids).logits
        eager = []
        for routes in (first, second):
            with routing_replay(model, routes):
                eager.append(model(input_ids=ids).logits)
        compiled = torch.compile(model, backend="eager")
        with routing_replay(model, first):
            assert torch.equal(compiled(input_ids=ids).logits, eager[0])
        assert torch.equal(compiled(input_ids=ids).logits, natural)
        with routing_replay(model, second):
            assert torch.equal(compiled(input_ids=ids).logits, eager[1])
        # Compiled before any hook existed (dynamo does not guard on module hooks): replay still routes.
        other = reference_copy(moe)
        compiled = torch.compile(other, backend="eager")
        assert torch.equal(compiled(input_ids=ids).logits, natural)
        with routing_replay(other, second):
            assert torch.equal(compiled(input_ids=ids).logits, eager[1])


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_families_the_paged_cache_cannot_serve_are_refused_when_the_engine_is_made(family):
    """DeepSeek-V3's latent attention and GPT-OSS's attention sinks: refused by name (every step failed)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, GptOssConfig

    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "deepseek_v3":
        config = DeepseekV3Config(
            **shape, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=TOP_K,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            first_k_dense_replace=0, n_group=1, topk_group=1,
        )  # fmt: skip
    else:
        config = GptOssConfig(
            **shape, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=TOP_K, head_dim=8
        )
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(FieldError, match="model: .*(latent attention|attention sinks)"):
        make_engine(model)


def test_routes_for_in_trl_layout_pads_completions_to_the_longest():
    """Prompts left-padded to prompt_pad_to, completions right-padded to the longest completion (TRL's input_ids:
    4 + 5 columns here), each route where its token's forward ran; bad padding arguments are named."""
    from types import SimpleNamespace

    def completion(prompt_len: int, tokens: int, expert: int) -> SimpleNamespace:
        rows = lambda count: np.full((count, 2, TOP_K), expert, dtype=np.int16)  # noqa: E731
        return SimpleNamespace(prompt_routes=rows(prompt_len - 1), routes=rows(tokens))

    batch = [completion(4, 2, 1), completion(2, 5, 2)]
    routes = routes_for(batch, prompt_pad_to=4)
    assert routes.shape == (2, 9, 2, TOP_K) and torch.equal(routes, routes_for(batch, pad_to=5, prompt_pad_to=4))
    assert (routes[0, :5, 0, 0] == 1).all() and (routes[0, 5:, 0, 0] == -1).all()  # 3 prompt + 2 sampling forwards
    assert (routes[1, :2, 0, 0] == -1).all() and (routes[1, 2:8, 0, 0] == 2).all() and routes[1, 8, 0, 0] == -1
    for kwargs, message in (({"pad_to": -1}, "pad_to"), ({"prompt_pad_to": 2.5}, "prompt_pad_to")):
        with pytest.raises(ValueError, match=message):
            routes_for(batch, **kwargs)
    with pytest.raises(ValueError, match=r"completions\[0\]: routes are \(tokens, layers, top_k\)"):
        routes_for([SimpleNamespace(prompt_routes=np.zeros((3, 2)), routes=np.zeros((2, 2)))])


def test_a_router_rollout_does_not_read_is_named_not_called_dense():
    """Llama4's router is no *TopKRouter: the refusal names it (it said the model was dense)."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1, head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="routes experts with Llama4Router, which rollout does not read"):
        with routing_replay(model, torch.zeros(1, 3, 2, 1, dtype=torch.long)):
            pass


def test_a_prefix_computed_again_after_the_weights_changed_in_place_lends_its_new_routes(moe):
    """`weights_changed()` (a colocated trainer's step) resets the prefix cache; the same prompt computed again lands
    under the same hash, here in the same blocks (a cache of 5), and a later request that takes them must get the
    routes of the new weights, not those the route cache kept from before the reset."""
    model = copy.deepcopy(moe)
    engine = make_engine(model, num_blocks=5, block_size=4)
    prompt = make_prompts(1, 13, 13, seed=2)[0]
    routed = SamplingParams(do_sample=False, stop_token_ids=(), return_routes=True)

    def prompt_routes(request_id: str) -> np.ndarray:
        engine.add_request(request_id, prompt, routed, max_new_tokens=3)
        return run_to_completion(engine)[request_id].prompt_routes

    prompt_routes("before")
    with torch.no_grad():
        torch.manual_seed(0)
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.copy_(torch.randn_like(parameter))
    engine.weights_changed()
    expected = reference_routes(reference_copy(model), prompt)[: len(prompt) - 1]
    assert np.array_equal(prompt_routes("computed"), expected)
    hits = engine.block_manager.num_prefix_tokens_hit
    assert np.array_equal(prompt_routes("cached"), expected)
    assert engine.block_manager.num_prefix_tokens_hit > hits, "the last request should take the cached blocks"
    engine.close()


def test_routes_refilled_in_place_between_forwards_are_checked_again(moe):
    """A trainer that keeps one routes buffer and refills it for each forward (`RouteReplay` with a `current` that
    returns it): routes were checked once per tensor object, so a refill routing a token twice to one expert, or to
    an expert the model does not have, was replayed unchecked (silently wrong experts, or an index error inside
    transformers' experts, a device-side assert on a GPU). Each change is checked again."""
    from trainer_bridge.route_replay import RouteReplay

    trainer = reference_copy(moe)
    ids = torch.tensor([[1, 2, 3, 4]])
    buffer = torch.arange(TOP_K).repeat(1, 4, 2, 1)  # experts 0 and 1 for every token
    replay = RouteReplay(trainer, lambda: buffer)
    try:
        with torch.no_grad():
            trainer(input_ids=ids)  # checked, and fine
            for refill, message in ((0, "same expert twice"), (99, "expert id 99")):
                buffer[0, 1, 0, :] = refill
                with pytest.raises(ValueError, match=message):
                    trainer(input_ids=ids)
                buffer.copy_(torch.arange(TOP_K).repeat(1, 4, 2, 1))
                trainer(input_ids=ids)  # fine again
    finally:
        replay.close()
    with torch.inference_mode():  # routes made in inference mode keep no version counter: checked once
        made = torch.arange(TOP_K).repeat(1, 4, 2, 1)
    with routing_replay(trainer, made), torch.no_grad():
        trainer(input_ids=ids)

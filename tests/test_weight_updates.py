"""Weight updates: `Engine.update_weights` (stepped by hand, so the update lands exactly between two chosen steps)
and `ContinuousBatchingManager.update_weights` / `weight_updates.submit` (background thread).

References are transformers' own: greedy `model.generate` on copies of the models taken before any engine touched
them, and, for "keep" mode (new weights continuing on KV computed by the old ones), a hand-built
`past_key_values` cache: model A runs over the tokens whose KV was computed before the update, then B's weights are
loaded into that same model and greedy decoding continues on the cache with plain forward calls.
"""

from __future__ import annotations

import copy
import queue
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import _COMMON, make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager, init_continuous_batching

pytestmark = pytest.mark.timeout(60)

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
TIMEOUT = 30.0  # seconds any single blocking call may wait


# ---- references -------------------------------------------------------------------------------------------------
def greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate: the `max_new_tokens` tokens after `ids`."""
    output = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return output[0, len(ids) :].tolist()


@torch.no_grad()
def mixed_kv_greedy(
    reference_a: torch.nn.Module, state_b: dict, under_a: list[int], under_b: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy tokens of weights B over a KV cache whose first tokens (`under_a`) were computed by weights A and the
    rest (`under_b`, at least one token) by B; built with transformers' DynamicCache and forward passes only."""
    model = copy.deepcopy(reference_a)
    cache = model(torch.tensor([under_a]), use_cache=True).past_key_values
    model.load_state_dict(state_b)
    logits = model(torch.tensor([under_b]), past_key_values=cache, use_cache=True).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(
            int(model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        )
    return tokens


def two_policies(kind: str = "qwen3"):
    """(engine model = weights A, reference copy of A, reference copy of B, B's state_dict): A and B differ."""
    model_a, model_b = tiny_model(kind, seed=0), tiny_model(kind, seed=1)
    return model_a, reference_copy(model_a), reference_copy(model_b), model_b.state_dict()


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_state_equal(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, tensor in snapshot.items():
        assert torch.equal(state[name], tensor), name


def step_n(engine, steps: int) -> dict:
    """Run exactly `steps` engine steps; return the final outputs they produced, by request id."""
    finished = {}
    for _ in range(steps):
        for output in engine.step():
            if output.is_finished:
                finished[output.request_id] = output
    return finished


def running(engine) -> dict:
    return {request.request_id: request for request in engine.scheduler.running}


# ---- 1. keep --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 6])
def test_keep_continues_on_old_kv_with_new_weights(k):
    """Requests with k tokens sampled by A continue under B on the KV A computed: token for token what
    transformers gives for "A's cache of prompt + first k-1 tokens, then B's weights"; the first k tokens are A's."""
    model, reference_a, reference_b, state_b = two_policies()
    max_new = 16
    prompts = make_prompts(2, 13, 27, seed=11)
    engine = make_engine(model)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY, max_new_tokens=max_new)
    assert step_n(engine, k) == {}
    sampled = {rid: request.output_ids for rid, request in running(engine).items()}
    assert sorted(sampled) == ["r0", "r1"] and all(len(tokens) == k for tokens in sampled.values())

    result = engine.update_weights(state_b, mode="keep")
    assert (result.version, result.mode, result.aborted, result.recomputed, result.outputs) == (1, "keep", 0, 0, [])
    assert engine.policy_version == 1 and engine.counters.weight_updates == 1
    assert 0 <= result.copy_ms <= result.pause_ms
    outputs = run_to_completion(engine)

    for index, prompt in enumerate(prompts):
        output = outputs[f"r{index}"]
        first = sampled[f"r{index}"]
        pure_a = greedy(reference_a, prompt, max_new)
        assert first == pure_a[:k]
        expected = first + mixed_kv_greedy(reference_a, state_b, prompt + first[:-1], first[-1:], max_new - k)
        # The reference must tell the modes apart, or this test could not fail.
        assert expected != pure_a and expected[k:] != greedy(reference_b, prompt + first, max_new - k)
        assert output.generated_tokens == expected, index
        assert output.policy_versions == [[0, 0], [1, k]]
        assert output.kv_version_min == 0
        assert output.finish_reason == "length"


# ---- 2. recompute ---------------------------------------------------------------------------------------------
def test_recompute_reprefills_prompt_and_tokens_under_new_weights():
    """After a "recompute" update, each in-flight sample's KV (prompt + its k tokens) is computed again by B and
    the continuation equals B's generate on prompt + those k tokens; result.recomputed counts the samples."""
    model, reference_a, reference_b, state_b = two_policies()
    max_new, k = 16, 5
    prompts = make_prompts(3, 10, 30, seed=12)
    engine = make_engine(model)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY, max_new_tokens=max_new)
    step_n(engine, k)
    sampled = {rid: request.output_ids for rid, request in running(engine).items()}
    assert all(len(tokens) == k for tokens in sampled.values()) and len(sampled) == 3

    computed_before = engine.counters.computed_tokens
    result = engine.update_weights(state_b, mode="recompute")
    assert (result.version, result.mode, result.recomputed, result.aborted) == (1, "recompute", 3, 0)
    outputs = run_to_completion(engine)
    # Every context token is computed again (prompt + k), then one per further sampled token but the last.
    assert engine.counters.computed_tokens - computed_before == sum(len(p) + max_new - 1 for p in prompts)

    for index, prompt in enumerate(prompts):
        output = outputs[f"r{index}"]
        first = sampled[f"r{index}"]
        assert first == greedy(reference_a, prompt, max_new)[:k]
        continuation = greedy(reference_b, prompt + first, max_new - k)
        assert continuation != greedy(reference_a, prompt, max_new)[k:]
        assert output.generated_tokens == first + continuation, index
        assert output.policy_versions == [[0, 0], [1, k]]
        assert output.kv_version_min == 1


# ---- 3. abort -------------------------------------------------------------------------------------------------
def abort_setup():
    """a, b: decoding (2 tokens each); c: mid chunked prefill (no token yet); d: queued, not admitted
    (max_num_seqs=3)."""
    model, reference_a, reference_b, state_b = two_policies()
    prompts = dict(zip("abcd", make_prompts(4, 12, 12, seed=13)))
    prompts["c"] = make_prompts(1, 40, 40, seed=14)[0]
    engine = make_engine(model, max_num_seqs=3, max_batch_tokens=32)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY, max_new_tokens=12)
    assert step_n(engine, 2) == {}
    now = running(engine)
    assert sorted(now) == ["a", "b", "c"] and [r.request_id for r in engine.scheduler.waiting] == ["d"]
    assert now["a"].num_output_tokens == now["b"].num_output_tokens == 2
    assert now["c"].num_output_tokens == 0 and 0 < now["c"].num_computed_tokens < 40
    return engine, prompts, reference_a, reference_b, state_b


def test_abort_ends_sampling_requests_and_runs_the_rest_under_new_weights():
    """ "abort": samples that sampled under A end now with finish_reason "abort" and their partial tokens (a prefix
    of A's greedy output), returned in result.outputs; one mid-prefill (nothing sampled) and one still queued run
    entirely under B and equal B's generate."""
    engine, prompts, reference_a, reference_b, state_b = abort_setup()
    result = engine.update_weights(state_b, mode="abort")
    assert (result.version, result.mode, result.aborted) == (1, "abort", 2)
    aborted = {output.request_id: output for output in result.outputs}
    assert sorted(aborted) == ["a", "b"]
    for rid in "ab":
        output = aborted[rid]
        assert output.is_finished and output.finish_reason == "abort"
        assert output.generated_tokens == greedy(reference_a, prompts[rid], 12)[:2]
        assert output.policy_versions == [[0, 0]] and output.kv_version_min == 0
    assert not engine.scheduler.running, "every in-flight KV is dropped"

    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["c", "d"], "aborted samples are not reported again"
    for rid in "cd":
        expected = greedy(reference_b, prompts[rid], 12)
        assert expected != greedy(reference_a, prompts[rid], 12)
        assert outputs[rid].generated_tokens == expected, rid
        assert outputs[rid].finish_reason == "length"
        assert outputs[rid].policy_versions == [[1, 0]] and outputs[rid].kv_version_min == 1


def test_abort_counts_mid_prefill_samples_it_recomputes():
    engine, *_, state_b = abort_setup()
    result = engine.update_weights(state_b, mode="abort")
    run_to_completion(engine)
    assert result.recomputed == 1  # sample c's partial prompt KV (computed by A) is dropped and recomputed by B


# ---- 4. wait, through the manager -------------------------------------------------------------------------------
class ForwardGate:
    """A forward pre-hook that stops the engine thread just before its `pause_at`-th forward until `go` is set."""

    def __init__(self, model: torch.nn.Module, pause_at: int):
        self.pause_at, self.calls = pause_at, 0
        self.paused, self.go = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.pause_at:
            self.paused.set()
            assert self.go.wait(TIMEOUT)

    def close(self):
        self.go.set()
        self.handle.remove()


@pytest.fixture
def managers():
    built: list[ContinuousBatchingManager] = []
    yield built
    for manager in built:
        manager.stop(block=True, timeout=TIMEOUT)
        assert not manager.is_running()
        manager.engine.block_manager.check_all_free()


def started_manager(built, model, prompts, pause_at, max_new):
    """A manager whose requests r0.. were queued before start (so all are prefilled in the first step), with its
    engine thread held just before forward number `pause_at` (each request then has pause_at - 1 tokens)."""
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, block_size=4)
    )
    built.append(manager)
    for index, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new, sampling=GREEDY)
    gate = ForwardGate(model, pause_at)
    manager.start()
    assert gate.paused.wait(TIMEOUT)
    return manager, gate


def test_manager_wait_drains_in_flight_under_old_weights_then_applies(managers):
    """ "wait": samples in flight when the update is submitted finish entirely under A (equal A's generate); a request
    added after submit (before the drain ends) is held back and runs entirely under B; drain_ms > 0. A second update
    submitted during the drain waits behind it and applies right after it, before the held request runs."""
    model, reference_a, reference_b, state_b = two_policies()
    prompts = make_prompts(3, 10, 25, seed=15)
    max_new = 16
    manager, gate = started_manager(managers, model, prompts[:2], pause_at=4, max_new=max_new)
    results: queue.SimpleQueue = queue.SimpleQueue()
    try:
        manager.weight_updates.submit(state_b, None, "wait", False, None, results.put)
        manager.add_request(prompts[2], request_id="r2", max_new_tokens=max_new, sampling=GREEDY)
        # A second update while the first still drains waits for it (the first one is unaffected).
        second: queue.SimpleQueue = queue.SimpleQueue()
        manager.weight_updates.submit(state_b, 7, "keep", False, None, second.put)
    finally:
        gate.close()
    result = results.get(timeout=TIMEOUT)
    assert not isinstance(result, BaseException), result
    assert (result.version, result.mode) == (1, "wait") and result.drain_ms > 0
    outputs = {rid: manager.get_result(rid, timeout=TIMEOUT) for rid in ("r0", "r1", "r2")}

    for index in (0, 1):
        output = outputs[f"r{index}"]
        assert output.generated_tokens == greedy(reference_a, prompts[index], max_new), index
        assert output.policy_versions == [[0, 0]] and output.kv_version_min == 0
    late = outputs["r2"]
    assert greedy(reference_b, prompts[2], max_new) != greedy(reference_a, prompts[2], max_new)
    assert late.generated_tokens == greedy(reference_b, prompts[2], max_new)
    assert late.policy_versions == [[7, 0]] and late.kv_version_min == 7
    after = second.get(timeout=TIMEOUT)
    assert (after.version, after.mode, after.drain_ms) == (7, "keep", 0.0)
    assert manager.engine.policy_version == 7 and manager.weight_updates.last_result is after
    assert manager.stats()["weight_updates"] == 2


def test_manager_wait_past_its_timeout_raises_and_changes_nothing(managers):
    """A "wait" update whose drain outlasts its timeout raises TimeoutError; weights, version and outputs stay A's,
    and admission resumes (a later request also runs under A)."""
    model, reference_a, _, state_b = two_policies()
    snapshot = state_snapshot(model)
    prompts = make_prompts(3, 10, 25, seed=16)
    max_new = 16
    manager, gate = started_manager(managers, model, prompts[:2], pause_at=3, max_new=max_new)
    release = threading.Timer(0.3, gate.close)  # the engine thread stays held well past the 0.05 s drain timeout
    release.start()
    try:
        with pytest.raises(TimeoutError):
            manager.update_weights(state_b, mode="wait", timeout=0.05)
    finally:
        release.join()
        gate.close()
    for index in (0, 1):
        output = manager.get_result(f"r{index}", timeout=TIMEOUT)
        assert output.generated_tokens == greedy(reference_a, prompts[index], max_new), index
        assert output.policy_versions == [[0, 0]]
    manager.add_request(prompts[2], request_id="r2", max_new_tokens=max_new, sampling=GREEDY)
    output = manager.get_result("r2", timeout=TIMEOUT)
    assert output is not None and output.generated_tokens == greedy(reference_a, prompts[2], max_new)
    assert output.policy_versions == [[0, 0]]
    assert manager.engine.policy_version == 0 and manager.weight_updates.last_result is None
    assert manager.stats()["weight_updates"] == 0
    assert_state_equal(model, snapshot)


def test_manager_abort_delivers_partial_outputs(managers):
    """Through the manager, "abort" delivers the aborted samples' partial outputs to their readers."""
    model, reference_a, reference_b, state_b = two_policies()
    prompts = make_prompts(2, 10, 25, seed=17)
    max_new = 16
    manager, gate = started_manager(managers, model, prompts[:1], pause_at=4, max_new=max_new)
    results: queue.SimpleQueue = queue.SimpleQueue()
    try:
        manager.weight_updates.submit(state_b, None, "abort", False, None, results.put)
    finally:
        gate.close()
    result = results.get(timeout=TIMEOUT)
    assert not isinstance(result, BaseException), result
    assert result.aborted == 1
    output = manager.get_result("r0", timeout=TIMEOUT)
    assert output.finish_reason == "abort" and output.policy_versions == [[0, 0]]
    # The forward in progress when the gate opened (4th) also sampled under A before the update was applied.
    assert output.generated_tokens == greedy(reference_a, prompts[0], max_new)[:4]
    manager.add_request(prompts[1], request_id="r1", max_new_tokens=max_new, sampling=GREEDY)
    assert manager.get_result("r1", timeout=TIMEOUT).generated_tokens == greedy(reference_b, prompts[1], max_new)


# ---- 5. groups ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_groups_spanning_an_update_record_versions_per_sample(mode):
    """Group g (n=3) has sampled k tokens under A; group late (n=2) is mid chunked prefill, not forked yet. Every
    sample of g gets [[0,0],[1,k]], every sample of late [[1,0]]; tokens follow the mode's reference."""
    model, reference_a, reference_b, state_b = two_policies()
    max_new, k = 12, 3
    prompt_g = make_prompts(1, 12, 12, seed=18)[0]
    prompt_late = make_prompts(1, 40, 40, seed=19)[0]
    engine = make_engine(model, max_batch_tokens=16)
    engine.add_request("g", prompt_g, GREEDY, n=3, max_new_tokens=max_new)
    engine.add_request("late", prompt_late, GREEDY, n=2, max_new_tokens=max_new)
    step_n(engine, k)
    now = running(engine)
    assert sorted(now) == ["g#0", "g#1", "g#2", "late#0"]
    assert all(now[f"g#{i}"].num_output_tokens == k for i in range(3))
    late_computed = now["late#0"].num_computed_tokens
    assert now["late#0"].num_output_tokens == 0 and 0 < late_computed < 40

    result = engine.update_weights(state_b, mode=mode)
    assert result.recomputed == (4 if mode == "recompute" else 0)
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["g#0", "g#1", "g#2", "late#0", "late#1"]

    first = greedy(reference_a, prompt_g, max_new)[:k]
    if mode == "keep":
        expected_g = first + mixed_kv_greedy(reference_a, state_b, prompt_g + first[:-1], first[-1:], max_new - k)
        expected_late = mixed_kv_greedy(
            reference_a, state_b, prompt_late[:late_computed], prompt_late[late_computed:], max_new
        )
    else:
        expected_g = first + greedy(reference_b, prompt_g + first, max_new - k)
        expected_late = greedy(reference_b, prompt_late, max_new)
    kv_min = 0 if mode == "keep" else 1
    for i in range(3):
        output = outputs[f"g#{i}"]
        assert output.generated_tokens == expected_g, i
        assert output.policy_versions == [[0, 0], [1, k]] and output.kv_version_min == kv_min, i
    for i in range(2):
        output = outputs[f"late#{i}"]
        assert output.generated_tokens == expected_late, i
        assert output.policy_versions == [[1, 0]] and output.kv_version_min == kv_min, i


# ---- 6. prefix cache ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("update", [False, True])
def test_prefix_cache_is_not_reused_across_an_update(update):
    """A prompt run twice reuses its cached prefix blocks; with an update in between it is computed in full and
    the output equals the new weights' generate."""
    model, reference_a, reference_b, state_b = two_policies()
    prompt, max_new = make_prompts(1, 21, 21, seed=20)[0], 8
    engine = make_engine(model, block_size=4)
    engine.add_request("first", prompt, GREEDY, max_new_tokens=max_new)
    assert run_to_completion(engine)["first"].generated_tokens == greedy(reference_a, prompt, max_new)
    assert engine.block_manager.cached_blocks
    if update:
        engine.update_weights(state_b)
    computed_before = engine.counters.computed_tokens
    engine.add_request("again", prompt, GREEDY, max_new_tokens=max_new)
    output = run_to_completion(engine)["again"]
    computed = engine.counters.computed_tokens - computed_before
    full = len(prompt) + max_new - 1
    if update:
        assert computed == full
        assert output.generated_tokens == greedy(reference_b, prompt, max_new)
        assert output.policy_versions == [[1, 0]]
    else:
        assert computed == full - 20  # 5 full blocks of 4 reused ((21 - 1) // 4)
        assert output.generated_tokens == greedy(reference_a, prompt, max_new)


def test_prefix_block_straddling_a_keep_update_is_not_reused():
    """Prompt prefill chunked (5 tokens per step, blocks of 8): A computes positions 0-4 of block 0, the "keep"
    update lands, B completes the block. A new request with the same prompt under B must not reuse that block."""
    model, reference_a, reference_b, state_b = two_policies()
    prompt, max_new = make_prompts(1, 20, 20, seed=21)[0], 8
    engine = make_engine(model, block_size=8, max_batch_tokens=5)
    engine.add_request("first", prompt, GREEDY, max_new_tokens=max_new)
    step_n(engine, 1)
    assert running(engine)["first"].num_computed_tokens == 5
    engine.update_weights(state_b, mode="keep")
    run_to_completion(engine)
    computed_before = engine.counters.computed_tokens
    engine.add_request("again", prompt, GREEDY, max_new_tokens=max_new)
    output = run_to_completion(engine)["again"]
    assert output.generated_tokens == greedy(reference_b, prompt, max_new)
    assert engine.counters.computed_tokens - computed_before == len(prompt) + max_new - 1


# ---- 7. validation --------------------------------------------------------------------------------------------
def _replace(state: dict, name: str, value) -> dict:
    """A copy of `state` with `name` moved to the end (so every other tensor comes before the bad one)."""
    out = {key: tensor for key, tensor in state.items() if key != name}
    out[name] = value
    return out


BAD_UPDATES = {
    "unknown_name": (
        lambda s: {**s, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)},
        {},
        "model.layers.9.mlp.up_proj.weight",
    ),
    "missing": (
        lambda s: {k: v for k, v in s.items() if k != "model.layers.1.mlp.down_proj.weight"},
        {},
        "model.layers.1.mlp.down_proj.weight",
    ),
    "wrong_shape": (
        lambda s: _replace(
            s, "model.layers.1.self_attn.q_proj.weight", s["model.layers.1.self_attn.q_proj.weight"][:, :32]
        ),
        {},
        "model.layers.1.self_attn.q_proj.weight",
    ),
    "wrong_dtype": (lambda s: _replace(s, "lm_head.weight", s["lm_head.weight"].double()), {}, "lm_head.weight"),
    "not_a_tensor": (lambda s: _replace(s, "lm_head.weight", s["lm_head.weight"].tolist()), {}, "tensors"),
    "version_not_above": (lambda s: s, {"version": 0}, "version"),
    "version_negative": (lambda s: s, {"version": -3}, "version"),
    "version_not_int": (lambda s: s, {"version": 1.5}, "version"),
    "bad_mode": (lambda s: s, {"mode": "later"}, "mode"),
    "wait_with_samples_in_flight": (lambda s: s, {"mode": "wait"}, "mode"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_update_is_refused_naming_the_culprit_and_changes_nothing(case):
    """Refused mid-generation (mode "recompute", so even a partly applied update would show): FieldError names the
    culprit; the weights, the version and the running request (A's generate to the end) are untouched."""
    make_tensors, kwargs, field = BAD_UPDATES[case]
    model, reference_a, _, state_b = two_policies()
    snapshot = state_snapshot(model)
    prompt, max_new = make_prompts(1, 15, 15, seed=22)[0], 12
    engine = make_engine(model)
    engine.add_request("r", prompt, GREEDY, max_new_tokens=max_new)
    step_n(engine, 3)
    with pytest.raises(FieldError) as error:
        engine.update_weights(make_tensors(state_b), **{"mode": "recompute", **kwargs})
    assert error.value.field == field
    assert engine.policy_version == 0 and engine.counters.weight_updates == 0
    assert_state_equal(model, snapshot)
    output = run_to_completion(engine)["r"]
    assert output.generated_tokens == greedy(reference_a, prompt, max_new)
    assert output.policy_versions == [[0, 0]] and output.kv_version_min == 0


def test_manager_refuses_a_bad_update_naming_the_tensor(managers):
    """The manager hands a refused update's FieldError back to the caller; the engine keeps serving A."""
    model, reference_a, _, state_b = two_policies()
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=4)
    )
    managers.append(manager)
    manager.start()
    bad = _replace(state_b, "model.norm.weight", state_b["model.norm.weight"][:-1])
    with pytest.raises(FieldError) as error:
        manager.update_weights(bad, timeout=TIMEOUT)
    assert error.value.field == "model.norm.weight"
    with pytest.raises(FieldError) as error:
        manager.update_weights(state_b, mode="soon", timeout=TIMEOUT)
    assert error.value.field == "mode"
    prompt = make_prompts(1, 10, 10, seed=23)[0]
    manager.add_request(prompt, request_id="r", max_new_tokens=8, sampling=GREEDY)
    assert manager.get_result("r", timeout=TIMEOUT).generated_tokens == greedy(reference_a, prompt, 8)
    assert manager.engine.policy_version == 0


def test_partial_update_changes_only_the_given_tensors():
    """partial=True accepts a subset: only lm_head changes (the output equals a copy of A with B's lm_head); the
    same subset without partial=True is refused naming a missing parameter."""
    model, reference_a, _, state_b = two_policies()
    subset = {"lm_head.weight": state_b["lm_head.weight"]}
    hybrid = copy.deepcopy(reference_a)
    hybrid.load_state_dict(subset, strict=False)
    prompt, max_new = make_prompts(1, 20, 20, seed=24)[0], 12
    assert greedy(hybrid, prompt, max_new) != greedy(reference_a, prompt, max_new)

    engine = make_engine(model)
    with pytest.raises(FieldError) as error:
        engine.update_weights(subset)
    assert error.value.field != "lm_head.weight" and error.value.field in state_b
    assert engine.policy_version == 0
    result = engine.update_weights(subset, partial=True)
    assert result.version == 1
    engine.add_request("r", prompt, GREEDY, max_new_tokens=max_new)
    assert run_to_completion(engine)["r"].generated_tokens == greedy(hybrid, prompt, max_new)


def test_explicit_version_is_used_and_the_next_one_follows_it():
    model, _, reference_b, state_b = two_policies()
    model_c = tiny_model("qwen3", seed=2)
    reference_c, state_c = reference_copy(model_c), model_c.state_dict()
    prompt, max_new = make_prompts(1, 12, 12, seed=25)[0], 8
    engine = make_engine(model)
    assert engine.update_weights(state_b, version=100).version == 100
    assert engine.policy_version == 100
    engine.add_request("r", prompt, GREEDY, max_new_tokens=max_new)
    output = run_to_completion(engine)["r"]
    assert output.generated_tokens == greedy(reference_b, prompt, max_new)
    assert output.policy_versions == [[100, 0]] and output.kv_version_min == 100
    for bad in (100, 50):
        with pytest.raises(FieldError) as error:
            engine.update_weights(state_c, version=bad)
        assert error.value.field == "version"
    assert engine.policy_version == 100
    assert engine.update_weights(state_c).version == 101
    engine.add_request("r", prompt, GREEDY, max_new_tokens=max_new)
    output = run_to_completion(engine)["r"]
    assert output.generated_tokens == greedy(reference_c, prompt, max_new)
    assert output.policy_versions == [[101, 0]]


# ---- 8. tied embeddings ---------------------------------------------------------------------------------------
def tied_llama(seed: int) -> torch.nn.Module:
    """A tiny Llama whose lm_head IS its input embedding. (conftest's gemma2 ties too, but its x8 sharpening of the
    shared matrix makes every seed just repeat the last prompt token; here a wide init and a sharpened final norm
    give seed-dependent, well-separated greedy tokens.)"""
    torch.manual_seed(seed)
    config = LlamaConfig(**_COMMON, tie_word_embeddings=True, initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("sent", ["model.embed_tokens.weight", "lm_head.weight"])
def test_tied_embeddings_need_only_one_name(sent):
    """One parameter, two state_dict names: a whole update that sends only one of the two names is accepted, both
    names then hold the new matrix, and the output equals the new model's generate."""
    model, model_b = tied_llama(0), tied_llama(1)
    reference_a, reference_b, state_b = reference_copy(model), reference_copy(model_b), model_b.state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= state_b.keys()
    dropped = ({"model.embed_tokens.weight", "lm_head.weight"} - {sent}).pop()
    tensors = {name: tensor for name, tensor in state_b.items() if name != dropped}
    prompt, max_new = make_prompts(1, 14, 14, seed=26)[0], 10
    expected = greedy(reference_b, prompt, max_new)
    assert expected != greedy(reference_a, prompt, max_new)

    engine = make_engine(model)
    assert engine.update_weights(tensors).version == 1
    assert torch.equal(model.lm_head.weight, state_b[sent])
    assert torch.equal(model.model.embed_tokens.weight, state_b[sent])
    engine.add_request("r", prompt, GREEDY, max_new_tokens=max_new)
    assert run_to_completion(engine)["r"].generated_tokens == expected


def test_tied_names_with_different_values_are_refused():
    """Both tied names sent with different values: refused naming the second one, nothing changes."""
    model, model_b = tied_llama(0), tied_llama(1)
    before = model.lm_head.weight.detach().clone()
    tensors = dict(model_b.state_dict())
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    engine = make_engine(model)
    with pytest.raises(ValueError) as raised:
        engine.update_weights(tensors)
    assert raised.value.field in {"lm_head.weight", "model.embed_tokens.weight"}
    assert "tied" in str(raised.value)
    assert torch.equal(model.lm_head.weight, before) and engine.policy_version == 0
    assert engine.update_weights(dict(model_b.state_dict())).version == 1  # equal values are fine


def test_manager_update_that_times_out_is_never_applied():
    """update_weights gives up after its timeout while the engine is busy: it raises TimeoutError and the update is
    dropped for good (not applied later behind the caller's back)."""
    model, model_b = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    release = threading.Event()
    hook = model.register_forward_pre_hook(lambda *_: release.wait(10))
    manager.start()
    try:
        manager.add_request(make_prompts(1, 10, 10, seed=3)[0], max_new_tokens=2, sampling=GREEDY)
        time.sleep(0.2)  # the engine thread is inside a forward, held by the hook
        with pytest.raises(TimeoutError):
            manager.update_weights(dict(model_b.state_dict()), timeout=0.1)
        release.set()
        time.sleep(1.0)  # the engine thread goes on; the dropped update must not land
        assert manager.engine.policy_version == 0
        assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    finally:
        release.set()
        hook.remove()
        manager.stop()


def test_versions_stay_within_int64():
    """Versions travel as int64: one beyond it is refused by name before anything changes."""
    engine = make_engine(tiny_model("qwen3"))
    with pytest.raises(FieldError, match="int64") as raised:
        engine.update_weights({}, version=2**63)
    assert raised.value.field == "version" and engine.policy_version == 0

"""Overlapped scheduling: step N+1 is scheduled and queued before step N's tokens reach the host.

The engine then holds a placeholder for each token still on the device, takes the next step's input ids from the
device, and learns of stop tokens one step late. References: transformers' `generate` (greedy), and the same engine
with overlap off (sampled runs: randomness is keyed per sample and position, so the outputs must not change).
"""

from __future__ import annotations

import pytest
import torch
from test_parity import GREEDY, reference_greedy
from test_weight_updates import two_policies
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_engine, make_prompts, needs_triton_interpreter, reference_copy, run_to_completion, tiny_model
from rollout.config import SamplingParams
from rollout.engine.requests.request import PLACEHOLDER_TOKEN
from rollout.engine.runner.step_inputs import UnresolvedTokens

MAX_NEW = 24


def spy_on_runner(engine) -> list[int]:
    """Record, per forward, how many input tokens came from the device (the previous step's unresolved samples)."""
    from_device: list[int] = []
    run = engine.runner.run

    def spy(batch, unresolved=None):
        covered = 0 if unresolved is None else sum(1 for seq in batch.sequences if seq.request in unresolved.rows)
        from_device.append(covered)
        return run(batch, unresolved)

    engine.runner.run = spy
    return from_device


def collect(engine, outputs: dict[str, list]) -> None:
    """Step until idle, appending every output to `outputs[request_id]`."""
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)


@pytest.mark.parametrize("kind", ["qwen3", "mistral_sliding"])  # (tiny gemma2 repeats one token: no varied stops)
def test_overlap_matches_generate_with_stops_preemption_and_arrivals(kind):
    """Greedy requests with stop tokens (hit at different steps), chunked prefill, a cache small enough to preempt,
    and requests arriving mid-run: every completion is generate's, cut after its first stop token, although stops
    are only seen one step late (the stopped sample's extra row is dropped and its blocks freed)."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    prompts = make_prompts(8, 5, 40, seed=21)
    free_running = [reference_greedy(reference, prompt, MAX_NEW) for prompt in prompts]
    stops = (free_running[0][3], free_running[1][9], free_running[2][15])
    expected = []
    for tokens in free_running:
        cut = next((i for i, token in enumerate(tokens) if token in stops), len(tokens) - 1)
        expected.append(tokens[: cut + 1])
    assert len({len(tokens) for tokens in expected}) > 2, "stops should end samples at different steps"
    sampling = SamplingParams(do_sample=False, stop_token_ids=stops)
    engine = make_engine(model, num_blocks=40, block_size=4, max_batch_tokens=32, overlap_scheduling=True)
    from_device = spy_on_runner(engine)
    for index in range(5):
        engine.add_request(str(index), prompts[index], sampling, max_new_tokens=MAX_NEW)
    outputs: dict[str, list] = {}
    for _ in range(6):
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    for index in range(5, 8):
        engine.add_request(str(index), prompts[index], sampling, max_new_tokens=MAX_NEW)
    collect(engine, outputs)
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    assert sum(from_device) > 0, "decode inputs should come from the previous step's tokens on the device"
    for index, tokens in enumerate(expected):
        (final,) = outputs[str(index)]
        assert final.generated_tokens == tokens, index
        assert final.finish_reason == ("stop" if tokens[-1] in stops else "length"), index
    engine.block_manager.check_all_free()


def test_overlap_computes_one_extra_row_per_stop_and_none_past_the_budget():
    """With room for everything, overlap computes exactly what sequential steps compute, plus one row per sample
    that stopped before its budget (seen one step late); a sample whose last token is its max_new_tokens-th is not
    scheduled again while that token is on the device."""
    prompts = make_prompts(6, 5, 30, seed=22)
    sampling = SamplingParams(do_sample=True, seed=4, stop_token_ids=tuple(range(0, 256, 23)))
    computed, stopped = [], []
    for overlap in (False, True):
        engine = make_engine(tiny_model("llama"), overlap_scheduling=overlap)
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, sampling, n=2, max_new_tokens=MAX_NEW)
        outputs = run_to_completion(engine)
        computed.append(engine.counters.computed_tokens)
        reasons = [o.finish_reason for o in outputs.values()]
        assert "length" in reasons
        stopped.append(
            sum(1 for o in outputs.values() if o.finish_reason == "stop" and len(o.generated_tokens) < MAX_NEW)
        )
    assert stopped[0] == stopped[1] > 0
    assert computed[1] - computed[0] == stopped[1]


def sampled_workload(engine, shared_prefix: list[int]) -> None:
    """Groups and singles mixing every sampling processor, stop tokens that end samples early, streaming, top
    logprobs and shared prefixes."""
    stops = (3, 17, 29, 41, 77, 99, 150, 201, 230, 250)
    prompts = [shared_prefix + tail for tail in make_prompts(4, 3, 12, seed=31)] + make_prompts(3, 20, 50, seed=32)
    group = SamplingParams(
        do_sample=True, temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.2,
        top_logprobs=2, stop_token_ids=stops, seed=1,
    )  # fmt: skip
    engine.add_request("g", prompts[0], group, n=3, max_new_tokens=MAX_NEW, streaming=True)
    min_p = SamplingParams(
        do_sample=True, min_p=0.05, min_new_tokens=5, frequency_penalty=0.3, stop_token_ids=stops, seed=2
    )
    engine.add_request("h", prompts[1], min_p, n=2, max_new_tokens=MAX_NEW)
    raw = SamplingParams(do_sample=True, temperature=1.2, logprob_mode="raw", stop_token_ids=stops, seed=3)
    engine.add_request("raw", prompts[2], raw, max_new_tokens=MAX_NEW, streaming=True)
    # Bans read a device-side token history; typical/epsilon/eta and temperature_scaled logprobs.
    bans = SamplingParams(
        do_sample=True, typical_p=0.8, epsilon_cutoff=0.001, eta_cutoff=0.002, no_repeat_ngram_size=1,
        bad_words_ids=((5,), (9, 11), (20, 21, 22)), suppress_tokens=(7,), begin_suppress_tokens=(8,),
        logprob_mode="temperature_scaled", stop_token_ids=stops, seed=4,
    )  # fmt: skip
    engine.add_request("bans", prompts[1], bans, n=2, max_new_tokens=MAX_NEW, streaming=True)
    greedy = SamplingParams(do_sample=False, stop_token_ids=stops)
    for index, prompt in enumerate(prompts[3:]):
        engine.add_request(f"s{index}", prompt, greedy if index % 2 else raw, max_new_tokens=MAX_NEW - 3 * index)


@pytest.mark.parametrize("swap", [0.0, 0.01], ids=str)
def test_overlap_gives_the_same_outputs_as_sequential_steps(swap):
    """The same sampled workload, overlap off then on, under a cache that preempts (recompute, or swap to CPU):
    every sample has the same tokens, log-probs, top log-probs, finish reason and versions, and streamed deltas add
    up to the same completions."""
    shared_prefix = make_prompts(1, 24, 24, seed=30)[0]
    runs = []
    for overlap in (False, True):
        model = tiny_model("qwen3")
        config = {"num_blocks": 36, "block_size": 4, "max_batch_tokens": 40, "cpu_offload_space": swap}
        engine = make_engine(model, overlap_scheduling=overlap, **config)
        sampled_workload(engine, shared_prefix)
        outputs: dict[str, list] = {}
        collect(engine, outputs)
        assert engine.scheduler.num_preemptions > 0
        if swap:
            assert engine.scheduler.num_swaps > 0
        engine.block_manager.check_all_free()
        runs.append(outputs)
    sequential, overlapped = runs
    assert sequential.keys() == overlapped.keys()
    reasons = [outputs[-1].finish_reason for outputs in sequential.values()]
    assert "stop" in reasons and "length" in reasons, reasons
    for request_id, deltas in sequential.items():
        other = overlapped[request_id]
        tokens = [t for output in deltas for t in output.generated_tokens]
        assert [t for output in other for t in output.generated_tokens] == tokens, request_id
        assert PLACEHOLDER_TOKEN not in tokens
        logprobs = [lp for output in deltas for lp in output.logprobs]
        assert torch.allclose(
            torch.tensor([lp for output in other for lp in output.logprobs]), torch.tensor(logprobs), atol=1e-5
        ), request_id
        top = [[i for i, _ in entry] for output in deltas for entry in output.top_logprobs]
        assert [[i for i, _ in entry] for output in other for entry in output.top_logprobs] == top, request_id
        final, other_final = deltas[-1], other[-1]
        assert (other_final.finish_reason, other_final.kv_version_min) == (final.finish_reason, final.kv_version_min)
        assert other_final.policy_versions == final.policy_versions
        if not final.finish_reason == "length":
            assert len(tokens) < MAX_NEW


def test_cancel_while_a_step_is_in_flight():
    """Cancelling a group with a step on the device first finishes that step: the group's outputs come back in
    order (its last tokens, then the aborts), and the other group loses nothing (its outputs of that step come with
    the next step) and completes as it would have without the cancel."""
    prompts = make_prompts(2, 10, 20, seed=41)
    sampling = SamplingParams(do_sample=True, temperature=0.8, seed=5, stop_token_ids=())
    reference_run = make_engine(tiny_model("llama"))
    reference_run.add_request("b", prompts[1], sampling, n=2, max_new_tokens=MAX_NEW)
    expected_b = {rid: outputs[0].generated_tokens for rid, outputs in _collected(reference_run).items()}

    engine = make_engine(tiny_model("llama"), overlap_scheduling=True)
    engine.add_request("a", prompts[0], sampling, n=2, max_new_tokens=MAX_NEW, streaming=True)
    engine.add_request("b", prompts[1], sampling, n=2, max_new_tokens=MAX_NEW, streaming=True)
    outputs: dict[str, list] = {}
    for _ in range(5):
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    streamed_a = sum(len(o.generated_tokens) for o in outputs["a#0"])
    cancelled = engine.cancel("a")
    assert {o.group_id for o in cancelled} == {"a"}
    for output in cancelled:
        outputs[output.request_id].append(output)
    for request_id in ("a#0", "a#1"):
        tokens = [t for o in outputs[request_id] for t in o.generated_tokens]
        # Five steps queued: the last one's token arrives with the cancel, not lost and not a placeholder.
        assert len(tokens) == 5 > streamed_a and PLACEHOLDER_TOKEN not in tokens
        assert outputs[request_id][-1].finish_reason == "abort" and outputs[request_id][-1].is_finished
    collect(engine, outputs)
    for request_id, tokens in expected_b.items():
        assert [t for o in outputs[request_id] for t in o.generated_tokens] == tokens, request_id
    engine.block_manager.check_all_free()


def _collected(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    collect(engine, outputs)
    return outputs


@pytest.mark.parametrize("mode", ["keep", "recompute", "abort"])
def test_weight_update_drains_the_step_in_flight(mode):
    """An update made while a step is on the device waits for it: that step's tokens are tagged with the old
    version and come back in the update's outputs; everything after runs on the new weights, exactly as with
    sequential steps (the update lands after the same number of steps)."""
    prompts = make_prompts(3, 8, 30, seed=51)
    runs = []
    for overlap in (False, True):
        model, _, _, state_b = two_policies()
        engine = make_engine(model, overlap_scheduling=overlap)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, GREEDY, max_new_tokens=16 - 2 * index, streaming=True)
        outputs: dict[str, list] = {}
        for _ in range(4):
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
        result = engine.update_weights(state_b, mode=mode)
        if overlap:
            assert {o.request_id for o in result.outputs} >= {"r0", "r1", "r2"}, "the in-flight step's deltas"
        for output in result.outputs:
            outputs.setdefault(output.request_id, []).append(output)
        collect(engine, outputs)
        engine.block_manager.check_all_free()
        runs.append(outputs)
    sequential, overlapped = runs
    for request_id, deltas in sequential.items():
        tokens = [t for o in deltas for t in o.generated_tokens]
        assert [t for o in overlapped[request_id] for t in o.generated_tokens] == tokens, request_id
        final, other = deltas[-1], overlapped[request_id][-1]
        assert (other.finish_reason, other.kv_version_min) == (final.finish_reason, final.kv_version_min)
        versions = [[v, i] for o in deltas for v, i in o.policy_versions]
        assert [[v, i] for o in overlapped[request_id] for v, i in o.policy_versions] == versions, request_id
    if mode != "abort":
        assert any(v == 1 for o in sequential["r0"] for v, _ in o.policy_versions), "tokens after the update"


class HostReads(TorchDispatchMode):
    """Records the ATen ops that make the host wait for a CUDA device: reading a value (`item`, what `int(t)`,
    `bool(t)` and 0-dim tensor indices lower to), ops whose output size depends on values (`nonzero`, boolean-mask
    indexing, `repeat_interleave` without `output_size`, `bincount`, `unique`)."""

    VALUE_SIZED = ("nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2", "unique_consecutive")

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.active = False  # recording (off while a swap-out, which waits by design, runs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.active:
            pass
        elif name in ("_local_scalar_dense", "item", "is_nonzero", "equal") or name in self.VALUE_SIZED:
            self.calls.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.calls.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
            index is not None and index.dtype in (torch.bool, torch.uint8) for index in args[1]
        ):
            self.calls.append(f"{name} with a boolean mask")
        return func(*args, **kwargs)


def every_processor_workload(engine, shared_prefix: list[int]) -> None:
    """Every sample uses every penalty and ban processor, min_new_tokens, top_k, top_p, min_p and top log-probs
    (the sampler then draws from each row's top candidates); groups, shared prefixes."""
    every = SamplingParams(
        do_sample=True, temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
        presence_penalty=0.3, frequency_penalty=0.2, no_repeat_ngram_size=2, bad_words_ids=((5,), (9, 11), (20, 21, 22)),
        suppress_tokens=(7,), begin_suppress_tokens=(8,), min_new_tokens=4, stop_token_ids=(3, 17, 29, 41),
        top_logprobs=3, seed=1,
    )  # fmt: skip
    prompts = [shared_prefix + tail for tail in make_prompts(3, 3, 12, seed=33)]
    for index, prompt in enumerate(prompts):
        params = every.merged(seed=index, no_repeat_ngram_size=2 + index)  # n-grams of several sizes in a step
        engine.add_request(f"e{index}", prompt, params, n=2 if index else 4, max_new_tokens=MAX_NEW, streaming=True)


@pytest.mark.parametrize(("workload", "samples"), [(sampled_workload, 12), (every_processor_workload, 8)])
@pytest.mark.parametrize("swap", [0.0, 0.01])
def test_launching_a_step_never_reads_the_device(monkeypatch, swap, workload, samples):
    """Queueing a step (block moves, inputs, forward, every sampling processor, log-probs) runs no op that brings
    a device value to the host: on CUDA each would stall the host until the step before had finished. Seen on CPU
    at the ATen level (tests/gpu checks the same with CUDA's own sync detector). Prefill chunks of unequal length,
    copy-on-write of forked samples and (with swap space) swap-ins included; swap-outs wait by design. Both on a
    mixed workload and with every penalty and ban processor on in every sample (the sampler's slot tables, their
    first fills and scatters included)."""
    engine = make_engine(
        tiny_model("qwen3"), overlap_scheduling=True, num_blocks=36, max_batch_tokens=24, cpu_offload_space=swap
    )
    workload(engine, make_prompts(1, 8, 8, seed=60)[0])
    launch = engine.loop._launch
    spy = HostReads()
    python_reads: list[str] = []
    for name in ("tolist", "numpy"):  # no ATen op behind these
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if spy.active:
                python_reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)

    def watched_launch(batch, previous):
        spy.active = True
        try:
            with spy:
                return launch(batch, previous)
        finally:
            spy.active = False

    def unwatched_swap_out(pairs, _swap_out=engine.kv_cache.swap_out):
        active, spy.active = spy.active, False
        try:
            return _swap_out(pairs)
        finally:
            spy.active = active

    engine.loop._launch = watched_launch
    engine.kv_cache.swap_out = unwatched_swap_out
    outputs = _collected(engine)
    assert len(outputs) == samples and engine.counters.steps > 10  # every sample of the workload
    if swap:
        assert engine.scheduler.num_swaps > 0
    assert spy.calls == [] and python_reads == []


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=needs_triton_interpreter)])
def test_device_tokens_replace_placeholders(graphs):
    """A decode whose input token is a placeholder reads it from the previous step's device tokens (eager and
    graph paths), giving the logits of the real token; a placeholder nothing covers is an error, not garbage."""
    if graphs:
        pytest.importorskip("triton")
    config = {"block_size": 16, "attention_backend": "triton"} if graphs else {}
    engine = make_engine(tiny_model("qwen3"), **config)
    if graphs:
        engine.runner.enable_decode_graphs(8, engine.max_model_len, capture=False)
    engine.add_request("r", make_prompts(1, 10, 10, seed=70)[0], GREEDY, max_new_tokens=8)
    engine.step()
    batch = engine.scheduler.schedule()
    request = batch.sequences[0].request
    token = request.token_ids[-1]
    expected = engine.runner.run(batch)
    request.token_ids[-1] = PLACEHOLDER_TOKEN
    with pytest.raises(RuntimeError, match="neither on the host nor among the previous step's samples"):
        engine.runner.run(batch)
    devices_tokens = UnresolvedTokens(torch.tensor([7, token]), {request: 1})
    assert torch.equal(engine.runner.run(batch, devices_tokens), expected)
    request.token_ids[-1] = token
    engine.close()


def test_placeholder_round_trip():
    """add_placeholder / resolve_token / drop_placeholder keep tokens, versions and finish reasons consistent."""
    from conftest import make_request

    request = make_request("r", [5, 6], max_new_tokens=2, stop_token_ids=(9,))
    request.add_placeholder(0)
    assert request.has_placeholder and request.num_output_tokens == 1 and not request.reached_max_tokens
    request.resolve_token(4)
    assert request.output_ids == [4] and request.finish_reason is None
    request.add_placeholder(3)
    assert request.reached_max_tokens and request.token_versions == [[0, 0], [3, 1]]
    request.drop_placeholder()
    assert request.output_ids == [4] and request.token_versions == [[0, 0]]
    with pytest.raises(RuntimeError, match="no sampled token to resolve"):
        request.resolve_token(9)
    request.add_placeholder(0)
    request.resolve_token(9)
    assert request.finish_reason == "stop" and request.output_ids == [4, 9]

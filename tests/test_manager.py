"""The public in-process API: `generate_batch`, `init_continuous_batching` and `ContinuousBatchingManager`
(lifecycle, streaming, result handlers, cancellation, errors at submit time, queue limits, cache exhaustion).

Reference tokens come from transformers' own `generate` on a copy of the model taken before the engine touched it.
Every blocking call carries a timeout, and an autouse fixture stops every manager a test built and checks that no KV
block leaked."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from conftest import _COMMON, VOCAB, make_prompts, reference_copy, tiny_model
from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    QueueFullError,
    SamplingParams,
    generate_batch,
    init_continuous_batching,
)

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0  # seconds any single blocking call may wait
GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
LONG = 900  # max_new_tokens of requests that must still be running when cancelled / stopped (model context 1024)


# ---- helpers ----------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def managers(monkeypatch):
    """Record every manager built during the test (generate_batch's included); afterwards stop each one with a
    timeout and require that its thread ended and every KV block is free."""
    built: list[ContinuousBatchingManager] = []
    original_init = ContinuousBatchingManager.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(ContinuousBatchingManager, "__init__", recording_init)
    yield built
    for manager in built:
        manager.stop(block=True, timeout=TIMEOUT)
        assert not manager.is_running(), "the engine thread did not stop"
        manager.engine.block_manager.check_all_free()


def cb_config(**overrides) -> ContinuousBatchingConfig:
    """A small explicit cache (never sized from memory)."""
    return ContinuousBatchingConfig(**{"num_blocks": 256, "block_size": 4, **overrides})


def new_manager(model=None, generation_config=None, **config) -> ContinuousBatchingManager:
    return init_continuous_batching(
        model if model is not None else tiny_model(), generation_config, cb_config(**config)
    )


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (the tiny models have no EOS, so it always runs to the length)."""
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return output[0, len(prompt) :].tolist()


def wait_until(predicate, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def result(manager: ContinuousBatchingManager, request_id: str | None = None):
    """The next output (of `request_id`), failing instead of hanging."""
    output = manager.get_result(request_id, timeout=TIMEOUT)
    assert output is not None, f"no output for {request_id!r} within {TIMEOUT}s"
    return output


def assert_serves(manager: ContinuousBatchingManager, request_id: str = "after") -> None:
    """The manager still completes a small request."""
    manager.add_request([5, 6, 7], request_id=request_id, max_new_tokens=3, sampling=GREEDY)
    output = result(manager, request_id)
    assert output.finish_reason == "length" and len(output.generated_tokens) == 3


def small_context_model(max_position_embeddings: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(**{**_COMMON, "max_position_embeddings": max_position_embeddings}, head_dim=16)
    return AutoModelForCausalLM.from_config(config).eval()


# ---- generate_batch ---------------------------------------------------------------------------------------------
def test_generate_batch_greedy_matches_generate_and_restores_attention():
    """Greedy outputs equal transformers' generate, keyed "req_<i>" in input order; the model gets its attention
    implementation back and still generates like the untouched copy."""
    model = tiny_model()
    reference = reference_copy(model)
    attn_before = model.config._attn_implementation
    prompts = make_prompts(4, 3, 20, seed=2)
    outputs = generate_batch(
        model, prompts, continuous_batching_config=cb_config(), progress_bar=False, sampling=GREEDY, max_new_tokens=8
    )
    assert list(outputs) == [f"req_{i}" for i in range(4)]
    for index, prompt in enumerate(prompts):
        output = outputs[f"req_{index}"]
        assert output.generated_tokens == reference_greedy(reference, prompt, 8), index
        assert output.prompt_ids == prompt and output.finish_reason == "length" and output.is_finished
    assert model.config._attn_implementation == attn_before
    assert reference_greedy(model, prompts[0], 4) == reference_greedy(reference, prompts[0], 4)


def test_generate_batch_takes_defaults_from_generation_config():
    """GenerationConfig(do_sample=False, max_new_tokens=7) alone gives 7 greedy tokens equal to generate."""
    model = tiny_model()
    reference = reference_copy(model)
    prompts = make_prompts(2, 4, 12, seed=3)
    outputs = generate_batch(
        model, prompts, GenerationConfig(do_sample=False, max_new_tokens=7), cb_config(), progress_bar=False
    )
    for index, prompt in enumerate(prompts):
        assert outputs[f"req_{index}"].generated_tokens == reference_greedy(reference, prompt, 7)


def test_generate_batch_per_prompt_sampling_params():
    """A list of SamplingParams applies one per prompt; a list of the wrong length names `sampling`."""
    model = tiny_model()
    reference = reference_copy(model)
    prompts = make_prompts(2, 4, 12, seed=4)
    per_prompt = [GREEDY.merged(max_new_tokens=3), GREEDY.merged(max_new_tokens=6)]
    outputs = generate_batch(
        model, prompts, continuous_batching_config=cb_config(), progress_bar=False, sampling=per_prompt
    )
    assert outputs["req_0"].generated_tokens == reference_greedy(reference, prompts[0], 3)
    assert outputs["req_1"].generated_tokens == reference_greedy(reference, prompts[1], 6)
    with pytest.raises(ValueError, match="sampling"):
        generate_batch(model, prompts, progress_bar=False, sampling=per_prompt[:1])


def test_generate_batch_n_samples_keyed_by_group_and_index():
    """n=3 returns "req_<i>#<j>" for every prompt, in input order, each sample complete (progress bar on)."""
    prompts = make_prompts(2, 4, 8, seed=5)
    sampling = SamplingParams(temperature=1.0, seed=0, stop_token_ids=(), max_new_tokens=5)
    outputs = generate_batch(tiny_model(), prompts, continuous_batching_config=cb_config(), sampling=sampling, n=3)
    assert list(outputs) == [f"req_{i}#{j}" for i in range(2) for j in range(3)]
    for key, output in outputs.items():
        assert output.group_id == key.split("#")[0] and output.sample_index == int(key.split("#")[1])
        assert len(output.generated_tokens) == 5 and output.finish_reason == "length"


def test_generate_batch_unknown_kwarg_raises_type_error():
    """An unknown keyword argument is a TypeError naming it, before anything runs."""
    model = tiny_model()
    attn_before = model.config._attn_implementation
    with pytest.raises(TypeError, match="temperature"):
        generate_batch(model, [[1, 2, 3]], progress_bar=False, temperature=0.5)
    assert model.config._attn_implementation == attn_before


# ---- lifecycle and results --------------------------------------------------------------------------------------
def test_context_manager_runs_requests_and_returns_ids():
    """`with manager:` starts and stops it; add_request returns the given id or a fresh unique one."""
    model = tiny_model()
    attn_before = model.config._attn_implementation
    manager = new_manager(model)
    with manager:
        assert manager.is_running()
        given = manager.add_request([1, 2, 3], request_id="mine", max_new_tokens=4, sampling=GREEDY)
        auto = [manager.add_request([4, 5], max_new_tokens=4, sampling=GREEDY) for _ in range(2)]
        assert given == "mine" and len(set(auto)) == 2 and "mine" not in auto
        ids = {result(manager).request_id for _ in range(3)}
        assert ids == {"mine", *auto}
    assert not manager.is_running()
    assert model.config._attn_implementation == attn_before


def test_streaming_delivers_deltas_of_new_tokens_only():
    """Streamed deltas concatenate to the non-streamed greedy result; only the last is finished, with a reason."""
    model = tiny_model()
    reference = reference_copy(model)
    prompt = make_prompts(1, 6, 6, seed=6)[0]
    with new_manager(model) as manager:
        manager.add_request(prompt, request_id="whole", max_new_tokens=8, sampling=GREEDY)
        whole = result(manager, "whole")
        manager.add_request(prompt, request_id="stream", max_new_tokens=8, sampling=GREEDY, streaming=True)
        deltas = list(manager.request_id_iter("stream", timeout=TIMEOUT))
    assert len(deltas) > 1
    assert all(not d.is_finished and d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].is_finished and deltas[-1].finish_reason == "length"
    streamed = [token for delta in deltas for token in delta.generated_tokens]
    assert streamed == whole.generated_tokens == reference_greedy(reference, prompt, 8)


def test_request_id_iter_ends_after_every_sample_of_a_streaming_group():
    """request_id_iter over a streaming n=2 group ends by itself once both samples finished (not by timeout)."""
    with new_manager() as manager:
        group = manager.add_request(
            [3, 1, 4, 1, 5], max_new_tokens=6, n=2, streaming=True, sampling=SamplingParams(seed=1, stop_token_ids=())
        )
        started = time.monotonic()
        deltas = list(manager.request_id_iter(group, timeout=3 * TIMEOUT))
        assert time.monotonic() - started < TIMEOUT, "the iterator waited for its timeout instead of ending"
    finished = [d for d in deltas if d.is_finished]
    assert sorted(d.request_id for d in finished) == [f"{group}#0", f"{group}#1"]
    for sample in (f"{group}#0", f"{group}#1"):
        assert sum(len(d.generated_tokens) for d in deltas if d.request_id == sample) == 6


def test_request_id_iter_yields_every_sample_of_a_group_that_already_finished():
    """Iterating a finished n=2 group whose outputs are still pending yields both samples, not just one."""
    manager = new_manager().start()
    group = manager.add_request([2, 7, 1, 8], max_new_tokens=3, n=2, sampling=GREEDY)
    wait_until(lambda: manager.stats()["generated_tokens"] >= 6)
    manager.stop(block=True, timeout=TIMEOUT)  # after join, both final outputs wait in the result queue
    outputs = list(manager.request_id_iter(group, timeout=0.5))
    assert sorted(o.request_id for o in outputs) == [f"{group}#0", f"{group}#1"]


def test_get_result_filters_by_id_and_times_out_with_none():
    """get_result(id) skips other requests' outputs; with nothing to return it gives None after the timeout."""
    with new_manager() as manager:
        started = time.monotonic()
        assert manager.get_result(timeout=0.05) is None
        assert time.monotonic() - started < 2
        manager.add_request([1, 2], request_id="short", max_new_tokens=1, sampling=GREEDY)
        manager.add_request([1, 2], request_id="long", max_new_tokens=6, sampling=GREEDY)
        assert result(manager, "long").request_id == "long"
        assert result(manager).request_id == "short"
        assert manager.get_result("long", timeout=0.05) is None


def test_register_result_handler_receives_every_output():
    """A registered handler gets the request's deltas on the engine thread, and they are not queued as well."""
    received, done = [], threading.Event()

    def handler(output):
        received.append(output)
        if output.is_finished:
            done.set()

    with new_manager() as manager:
        manager.register_result_handler("h", handler)
        manager.add_request([9, 8, 7], request_id="h", max_new_tokens=5, streaming=True, sampling=GREEDY)
        assert done.wait(TIMEOUT)
        assert manager.get_result("h", timeout=0.05) is None
    assert sum(len(o.generated_tokens) for o in received) == 5
    assert received[-1].finish_reason == "length" and all(o.request_id == "h" for o in received)


def test_cancel_request_delivers_partial_output_with_abort():
    """Cancelling a long request mid-generation returns its partial (correct) tokens with finish_reason "abort"."""
    model = tiny_model()
    reference = reference_copy(model)
    prompt = make_prompts(1, 8, 8, seed=7)[0]
    with new_manager(model) as manager:
        manager.add_request(prompt, request_id="long", max_new_tokens=LONG, sampling=GREEDY)
        wait_until(lambda: manager.stats()["generated_tokens"] > 0)
        manager.cancel_request("long")
        output = result(manager, "long")
        assert_serves(manager)
    assert output.finish_reason == "abort" and output.is_finished
    assert 0 < len(output.generated_tokens) < LONG
    head = output.generated_tokens[:16]
    assert head == reference_greedy(reference, prompt, len(head))


def test_cancel_request_aborts_every_sample_of_a_group():
    """Cancelling an n=3 group (by a sample's id) ends all three samples with "abort"."""
    with new_manager() as manager:
        group = manager.add_request([1, 2, 3, 4], max_new_tokens=LONG, n=3, sampling=SamplingParams(seed=0))
        wait_until(lambda: manager.stats()["generated_tokens"] > 0)
        manager.cancel_request(f"{group}#1")
        outputs = [result(manager, group) for _ in range(3)]
        assert manager.get_result(group, timeout=0.05) is None
    assert sorted(o.request_id for o in outputs) == [f"{group}#{i}" for i in range(3)]
    assert all(o.finish_reason == "abort" and o.is_finished and len(o.generated_tokens) < LONG for o in outputs)


def test_stop_with_requests_in_flight_aborts_them():
    """stop() ends running requests with "abort" without hanging; a stopped manager cannot be restarted and
    get_result on it answers at once."""
    model = tiny_model()
    attn_before = model.config._attn_implementation
    manager = new_manager(model).start()
    for name in ("a", "b"):
        manager.add_request([1, 2, 3], request_id=name, max_new_tokens=LONG, sampling=GREEDY)
    wait_until(lambda: manager.stats()["generated_tokens"] > 0)
    manager.stop(block=True, timeout=TIMEOUT)
    assert not manager.is_running()
    outputs = {name: result(manager, name) for name in ("a", "b")}
    assert all(o.finish_reason == "abort" and len(o.generated_tokens) < LONG for o in outputs.values())
    started = time.monotonic()
    assert manager.get_result(timeout=TIMEOUT) is None and time.monotonic() - started < 2
    assert model.config._attn_implementation == attn_before
    with pytest.raises(RuntimeError):
        manager.start()


def test_stop_before_a_request_started_aborts_it():
    """A request still queued when the manager stops ends like any unfinished one: "abort", with its prompt."""
    manager = new_manager()
    manager.add_request([1, 2, 3], request_id="queued", max_new_tokens=4, sampling=GREEDY)
    manager.stop(block=True, timeout=TIMEOUT)
    output = result(manager, "queued")
    assert output.finish_reason == "abort" and output.prompt_ids == [1, 2, 3]


def test_is_running_and_join():
    """is_running follows start/stop; start twice is a no-op; join(timeout) returns once stopped."""
    manager = new_manager()
    assert not manager.is_running()
    assert manager.start() is manager and manager.start() is manager and manager.is_running()
    manager.stop(block=False)
    manager.join(timeout=TIMEOUT)
    assert not manager.is_running()


def test_warmup_before_start_leaves_cache_free():
    """warmup() runs before start, frees every block, leaves admission's statistics and results unaffected; after
    start it is refused."""
    model = tiny_model()
    reference = reference_copy(model)
    manager = new_manager(model)
    before = copy.deepcopy(vars(manager.engine.scheduler.admission.growth))
    manager.warmup()
    manager.engine.block_manager.check_all_free()
    # admission learned nothing from it (a request ending at its max_new_tokens would say lengths are known)
    assert vars(manager.engine.scheduler.admission.growth) == before
    assert manager.get_result(timeout=0.05) is None  # the warm-up output is not delivered
    with manager:
        with pytest.raises(RuntimeError):
            manager.warmup()
        manager.add_request([0] * 8, request_id="r", max_new_tokens=4, sampling=GREEDY)
        assert result(manager, "r").generated_tokens == reference_greedy(reference, [0] * 8, 4)


# ---- errors -----------------------------------------------------------------------------------------------------
BAD_REQUESTS = {
    "empty prompt": ("input_ids", dict(input_ids=[])),
    "token id = vocab": ("input_ids", dict(input_ids=[1, VOCAB])),
    "negative token id": ("input_ids", dict(input_ids=[-1, 2])),
    "over max_model_len": ("max_new_tokens", dict(input_ids=[1] * 60, max_new_tokens=5)),
    "negative max_new_tokens": ("max_new_tokens", dict(input_ids=[1], max_new_tokens=-1)),
    "n=0": ("n", dict(input_ids=[1], n=0)),
    "n not an int": ("n", dict(input_ids=[1], n=2.0)),
    "sampling as a list": ("sampling", dict(input_ids=[1], sampling=[0.5])),
    "top_k over vocab": ("top_k", dict(input_ids=[1], max_new_tokens=2, sampling=SamplingParams(top_k=VOCAB + 1))),
    "stop token over vocab": (
        "stop_token_ids",
        dict(input_ids=[1], max_new_tokens=2, sampling=SamplingParams(stop_token_ids=(VOCAB,))),
    ),
    "empty request_id": ("request_id", dict(input_ids=[1], request_id="")),
    "streaming not a bool": ("streaming", dict(input_ids=[1], streaming="yes")),
    "record_timestamps not a bool": ("record_timestamps", dict(input_ids=[1], record_timestamps=1)),
}


@pytest.mark.parametrize("field, kwargs", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_add_request_rejects_bad_input_naming_the_field(field, kwargs):
    """Bad input raises ValueError naming the field at once; nothing is queued and the manager serves others."""
    with new_manager(max_model_len=64) as manager:
        with pytest.raises(ValueError, match=field):
            manager.add_request(**kwargs)
        assert_serves(manager)
        assert manager.get_result(timeout=0.05) is None


def test_add_request_rejects_zero_max_new_tokens():
    """max_new_tokens=0 is invalid like any value < 1 and must name the field."""
    manager = new_manager()
    with pytest.raises(ValueError, match="max_new_tokens"):
        manager.add_request([1, 2, 3], max_new_tokens=0)


def test_add_request_rejects_bool_token_naming_input_ids():
    """A bool in the prompt is not a token id: ValueError naming input_ids (not a bare StopIteration)."""
    manager = new_manager()
    with pytest.raises(ValueError, match="input_ids"):
        manager.add_request([1, True])


def test_prompt_plus_max_new_tokens_over_model_context():
    """With max_position_embeddings=32, 30 + 3 tokens is refused naming max_new_tokens; 29 + 3 is served."""
    with new_manager(small_context_model(32)) as manager:
        with pytest.raises(ValueError, match="max_new_tokens"):
            manager.add_request([1] * 30, max_new_tokens=3, sampling=GREEDY)
        manager.add_request([1] * 29, request_id="fits", max_new_tokens=3, sampling=GREEDY)
        assert result(manager, "fits").finish_reason == "length"


def test_duplicate_request_id_while_running():
    """Reusing the id of an unfinished request names request_id; once it finished, the id is free again."""
    with new_manager() as manager:
        manager.add_request([1, 2], request_id="dup", max_new_tokens=LONG, sampling=GREEDY)
        with pytest.raises(ValueError, match="request_id"):
            manager.add_request([3, 4], request_id="dup", max_new_tokens=2)
        manager.cancel_request("dup")
        assert result(manager, "dup").finish_reason == "abort"
        assert_serves(manager, request_id="dup")


INVALID_SAMPLING = [
    ("temperature", dict(temperature=-1)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-1)),
    ("min_p", dict(min_p=2)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("min_new_tokens", dict(min_new_tokens=-1)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=list(range(1025)))),  # refused from its length, before its items
    ("do_sample", dict(do_sample="yes")),
    ("seed", dict(seed="0")),
    ("logprob_mode", dict(logprob_mode="log")),
    ("top_logprobs", dict(top_logprobs=101)),
]


@pytest.mark.parametrize(
    "field, kwargs", INVALID_SAMPLING, ids=[f"{f}={v}" for f, k in INVALID_SAMPLING for v in k.values()]
)
def test_sampling_params_reject_invalid_values(field, kwargs):
    """Each invalid SamplingParams value raises ValueError naming its field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


INVALID_CONFIG = [
    ("block_size", dict(block_size=0)),
    ("num_blocks", dict(num_blocks=0)),
    ("max_batch_tokens", dict(max_batch_tokens=0)),
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("max_memory_percent", dict(max_memory_percent=2)),
    ("scheduler_type", dict(scheduler_type="x")),
    ("allow_block_sharing", dict(allow_block_sharing="yes")),
    ("cpu_offload_space", dict(cpu_offload_space=-1)),
    ("cpu_offload_space", dict(cpu_offload_space=float("inf"))),  # passed, then overflowed sizing the swap space
    ("cpu_offload_space", dict(cpu_offload_space=float("nan"))),
    ("max_queue_size", dict(max_queue_size=-1)),
    ("max_model_len", dict(max_model_len=1)),
]


@pytest.mark.parametrize(
    "field, kwargs", INVALID_CONFIG, ids=[f"{f}={v}" for f, k in INVALID_CONFIG for v in k.values()]
)
def test_continuous_batching_config_rejects_invalid_fields(field, kwargs):
    """Each invalid ContinuousBatchingConfig value raises ValueError naming its field."""
    with pytest.raises(ValueError, match=field):
        ContinuousBatchingConfig(**kwargs)


def test_full_queue_raises_queue_full_error_at_once():
    """With max_queue_size=2 and the manager not started, the third add_request raises QueueFullError at once;
    once started, the two queued requests complete and the queue accepts again."""
    manager = new_manager(max_queue_size=2)
    for name in ("a", "b"):
        manager.add_request([1, 2], request_id=name, max_new_tokens=2, sampling=GREEDY)
    started = time.monotonic()
    with pytest.raises(QueueFullError):
        manager.add_request([1, 2], request_id="c", max_new_tokens=2)
    assert time.monotonic() - started < 1
    with manager:
        assert {result(manager).request_id for _ in range(2)} == {"a", "b"}
        assert_serves(manager)


@pytest.mark.parametrize("prompt_len, max_new", [(20, 2), (10, 10)], ids=["prompt too long", "prompt+output too long"])
def test_request_that_never_fits_the_cache_ends_with_error(prompt_len, max_new):
    """A request needing more than the whole cache (4 blocks of 4) ends with "error" and a message; a following
    small request still completes, with the right tokens."""
    model = tiny_model()
    reference = reference_copy(model)
    with new_manager(model, num_blocks=4, block_size=4) as manager:
        manager.add_request(list(range(1, prompt_len + 1)), request_id="huge", max_new_tokens=max_new, sampling=GREEDY)
        failed = result(manager, "huge")
        manager.add_request([1, 2, 3, 4], request_id="small", max_new_tokens=4, sampling=GREEDY)
        small = result(manager, "small")
    assert failed.finish_reason == "error" and failed.is_finished and failed.error
    assert small.finish_reason == "length"
    assert small.generated_tokens == reference_greedy(reference, [1, 2, 3, 4], 4)


def test_a_warm_up_whose_request_fails_says_why():
    """A model whose forward fails (every request would end with an error) fails its warm-up with the error, before
    a worker says it is ready; the engine still closes."""
    from conftest import make_engine

    model = tiny_model()

    def broken(*args, **kwargs):
        raise NotImplementedError("this forward is not served")

    engine = make_engine(model)  # built whole: the forward breaks afterwards (a forward failing already is refused)
    model.model.forward = broken
    try:
        with pytest.raises(RuntimeError, match="warm-up request failed: .*this forward is not served"):
            engine.warmup()
    finally:
        engine.close()


def test_request_id_iter_ends_when_another_reader_took_the_last_outputs():
    """An iterator over a streaming request whose remaining outputs get_result read ends (it waited forever)."""
    with new_manager() as manager:
        request = manager.add_request([1, 2, 3], max_new_tokens=6, streaming=True, sampling=GREEDY)
        iterator = manager.request_id_iter(request, timeout=3 * TIMEOUT)
        assert not next(iterator).is_finished
        while not manager.get_result(request, timeout=TIMEOUT).is_finished:
            pass
        started = time.monotonic()
        assert list(iterator) == []
        assert time.monotonic() - started < TIMEOUT


def test_a_handler_registered_early_on_a_sample_id_gets_its_request_outputs():
    """register_result_handler("h#0") before add_request(request_id="h", n=2): the handler serves the request, as
    one registered on a sample id after add_request does (its outputs were queued instead)."""
    received, done = [], threading.Event()

    def handler(output):
        received.append(output)
        if sum(o.is_finished for o in received) == 2:
            done.set()

    with new_manager() as manager:
        manager.register_result_handler("h#0", handler)
        manager.add_request([9, 8, 7], request_id="h", n=2, max_new_tokens=3, sampling=GREEDY)
        assert done.wait(TIMEOUT)
        assert manager.get_result("h", timeout=0.05) is None
    assert sorted(o.request_id for o in received) == ["h#0", "h#1"]

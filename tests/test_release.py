"""Memory is released by its owner's close, never by a garbage collection: with the collector off, the KV cache, the
swap space and the decode graphs are gone once each entry point returns or closes, and nothing of the engine sits
in a reference cycle (a GPU process collects rarely, and a ~69 GB cache left to the collector starves what runs
next)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from conftest import needs_triton_interpreter, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch, init_continuous_batching
from rollout.engine.engine import Engine
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.service.launch.cli import build_parser
from rollout.service.launch.startup import start_worker
from trainer_bridge import ColocatedEngine, PromptGroup, RolloutClient

SAMPLING = SamplingParams(max_new_tokens=4, stop_token_ids=())
# A swap space, so that its tensor is watched too.
CONFIG = dict(num_blocks=64, block_size=16, cpu_offload_space=0.001)


class Watched:
    """Weak references to every KV cache and swap tensor allocated while it is active."""

    def __init__(self) -> None:
        self.tensors: list[weakref.ref] = []

    def alive(self) -> int:
        """How many watched tensors are still allocated."""
        return sum(ref() is not None for ref in self.tensors)


@pytest.fixture
def watched(monkeypatch) -> Iterator[Watched]:
    """Collector off for the test; every cache tensor the engine allocates is watched."""
    found = Watched()
    restore = PagedKVCache.restore

    def watching_restore(cache: PagedKVCache) -> None:
        restore(cache)
        found.tensors.append(weakref.ref(cache.kv))
        if cache.swap is not None:
            found.tensors.append(weakref.ref(cache.swap))

    monkeypatch.setattr(PagedKVCache, "restore", watching_restore)
    gc.collect()
    gc.disable()
    try:
        yield found
    finally:
        gc.enable()


def engine_garbage() -> list[str]:
    """Types of rollout objects that only a garbage collection would free (they sit in reference cycles)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("rollout.")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return kinds


def test_generate_batch_frees_its_engine_on_return(watched):
    model = tiny_model()
    outputs = generate_batch(
        model, [[1, 2, 3]], sampling=SAMPLING, continuous_batching_config=ContinuousBatchingConfig(**CONFIG)
    )
    assert len(outputs["req_0"].generated_tokens) == 4
    assert len(watched.tensors) == 2 and watched.alive() == 0
    assert engine_garbage() == [], engine_garbage.__name__


def test_engine_close_frees_the_cache_while_the_engine_is_still_held(watched):
    model = tiny_model()
    engine = Engine(model, ContinuousBatchingConfig(**CONFIG))
    engine.add_request("g", [1, 2, 3], SAMPLING)
    while engine.has_unfinished():
        engine.step()
    assert watched.alive() == 2
    engine.close()
    assert watched.alive() == 0 and engine.kv_cache.is_released
    del engine
    assert engine_garbage() == [], engine_garbage.__name__


@needs_triton_interpreter
def test_decode_graphs_are_freed_by_close(watched):
    """The graphs' buffers (on CUDA their memory pool) go with close, with no cycle through the runner."""
    model = tiny_model()
    engine = Engine(model, ContinuousBatchingConfig(**CONFIG, attention_backend="triton", use_cuda_graph=False))
    graphs = weakref.ref(engine.runner.enable_decode_graphs(4, 64, capture=False))
    engine.add_request("g", [1, 2, 3], SAMPLING)
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert graphs() is None and watched.alive() == 0
    del engine
    assert engine_garbage() == [], engine_garbage.__name__


def test_manager_stop_frees_the_cache_and_leaves_no_cycle(watched):
    model = tiny_model()
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(**CONFIG))
    with manager:
        request_id = manager.add_request([1, 2, 3], sampling=SAMPLING)
        assert len(manager.get_result(request_id, timeout=60).generated_tokens) == 4
    assert watched.alive() == 0  # the manager is still held: stop() itself freed it
    assert manager.stats()["generated_tokens"] >= 4  # and what it counted stays readable
    del manager
    assert engine_garbage() == [], engine_garbage.__name__


def test_colocated_close_frees_the_cache(watched):
    model = tiny_model()
    engine = ColocatedEngine(model, ContinuousBatchingConfig(**CONFIG))
    [result] = engine.generate([PromptGroup([1, 2, 3], n=2, sampling=SAMPLING)])
    assert [len(c.token_ids) for c in result.completions] == [4, 4]
    engine.sleep()
    engine.generate([PromptGroup([1, 2, 3], sampling=SAMPLING)])  # wakes: a second cache tensor
    engine.close()
    assert watched.alive() == 0
    del engine
    assert engine_garbage() == [], engine_garbage.__name__


def test_worker_shutdown_frees_the_cache(watched):
    parser = build_parser()
    args = parser.parse_args(["--bind", "tcp://127.0.0.1:*", "--num-blocks", "64", "--device", "cpu"])
    running = start_worker(parser, args)
    serving = threading.Thread(target=running.serve)
    serving.start()
    try:
        with RolloutClient(running.worker.address, timeout=60) as client:
            result = client.generate(PromptGroup([1, 2, 3], sampling={"max_new_tokens": 4, "stop_token_ids": []}))
            assert len(result.completions[0].token_ids) == 4
        assert watched.alive() == 1
    finally:
        running.worker.shutdown()
        serving.join(60)
    assert not serving.is_alive() and watched.alive() == 0
    del running
    assert engine_garbage() == [], engine_garbage.__name__


def test_a_closed_engine_refuses_work_by_name():
    engine = Engine(tiny_model(), ContinuousBatchingConfig(**CONFIG))
    engine.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.add_request("g", [1, 2, 3], SAMPLING)
    with pytest.raises(RuntimeError, match="closed engine"):
        engine.warmup()


def test_a_closed_engine_refuses_weight_changes_and_leaves_the_model_alone():
    """The model is the caller's again once its engine closed: an update must not write into it, nor an adapter
    load or unload report success, and the policy version stays where it was."""
    from rollout.engine.lora.adapter_weights import LoraModule

    model = tiny_model()
    engine = Engine(model, ContinuousBatchingConfig(**CONFIG, max_loras=1, max_lora_rank=4))
    engine.close()
    name = "model.layers.0.self_attn.q_proj"
    weight = model.get_parameter(f"{name}.weight")
    before = weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"update_weights\(\) of a closed engine"):
        engine.update_weights({f"{name}.weight": torch.zeros_like(weight)}, partial=True)
    lora = LoraModule(torch.zeros(4, weight.shape[1]), torch.zeros(weight.shape[0], 4), 1.0)
    with pytest.raises(RuntimeError, match=r"load_adapter\(\) of a closed engine"):
        engine.load_adapter("a", {name: lora})
    with pytest.raises(RuntimeError, match=r"unload_adapter\(\) of a closed engine"):
        engine.unload_adapter("a")
    assert torch.equal(weight, before) and engine.policy_version == 0


def test_a_colocated_engine_that_fails_to_build_leaves_nothing_on_the_model():
    model = tiny_model(dtype=torch.bfloat16)  # bf16: fp32_logits hooks an fp32 copy of the head onto it
    head = model.get_output_embeddings()
    with pytest.raises(ValueError, match="policy_version"):
        ColocatedEngine(model, ContinuousBatchingConfig(**CONFIG, fp32_logits=True), policy_version=-1)
    assert not head._forward_hooks and model.config._attn_implementation != "rollout_paged"


def test_close_lets_the_compiled_decode_forward_go():
    """A torch.compile'd decode forward (its guards, its compiled graphs) is held by nothing of the engine after
    close, while the engine itself is still held."""
    from transformers import CompileConfig

    config = ContinuousBatchingConfig(**CONFIG, decode_compile_config=CompileConfig(mode="default"))
    engine = Engine(tiny_model(), config)
    compiled = weakref.ref(engine.runner._decode_forward)
    assert compiled() is not engine.runner._forward
    engine.close()
    gc.collect()  # torch.compile's wrapper holds cycles of its own
    assert compiled() is None

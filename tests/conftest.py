"""Shared factories: tiny random transformers models built from configs (no downloads), engines, schedulers."""

from __future__ import annotations

import copy
import functools
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

# Triton kernels run in Triton's interpreter on machines without CUDA. The variable must be set before anything
# imports triton (transformers does, through the engine), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n 2`), each test process and what it starts computes on one thread: two processes of two
# threads each would oversubscribe two cores, and OpenMP's waiting threads spin.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import kernel_compile_job  # noqa: E402
import worker_zygote  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from fakes import FakeZero3  # noqa: E402
from rollout.config import ContinuousBatchingConfig, SamplingParams  # noqa: E402
from rollout.engine.engine import Engine
from rollout.engine.requests.request import Request
from rollout.engine.scheduling.admission import GrowthReserve
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.scheduler import Scheduler


def _triton_interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run kernels here (None when it can, or when kernels run compiled). Triton
    before 3.7 turns one-element arrays into ints in a way numpy 2.4 refuses (triton-lang/triton#9171): the GPU
    image's Triton 3.6 beside its numpy 2.5 is such a pair."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        triton_version, numpy_version = importlib.metadata.version("triton"), importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return None
    if Version(triton_version) < Version("3.7") and Version(numpy_version) >= Version("2.4"):
        return (
            f"Triton {triton_version}'s interpreter breaks under numpy {numpy_version} (triton-lang/triton#9171, "
            "fixed in Triton 3.7): these run compiled on a GPU, or in the interpreter with numpy<2.4"
        )
    return None


# Tests that run Triton kernels in the interpreter on CPU: skipped, with the reason, where the interpreter is broken.
TRITON_INTERPRETER_PROBLEM = _triton_interpreter_problem()
needs_triton_interpreter = pytest.mark.skipif(
    TRITON_INTERPRETER_PROBLEM is not None, reason=TRITON_INTERPRETER_PROBLEM or ""
)


def compile_for_gpus(script: str, cache: Path) -> list:
    """Run `script` (Python that compiles kernels with `triton.compile` for GPU targets and prints a JSON list as
    its last line) in a subprocess without Triton's interpreter, with `cache` as its Triton cache; that list."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(cache)
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

MODEL_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    # A window shorter than the test sequences, so the sliding mask matters.
    "mistral_sliding": lambda: MistralConfig(**_COMMON, sliding_window=24),
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=24, query_pre_attn_scalar=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **{**_COMMON, "intermediate_size": 64},
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
}


def tiny_model(kind: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random causal LM of the given family, deterministic for a seed."""
    torch.manual_seed(seed)
    config = MODEL_CONFIGS[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Random init gives near-uniform logits; sharpen them so greedy ties are vanishingly rare.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy for transformers' own generate / forward (the engine switches attention on its model).
    Its generation config has no EOS, like the engine's requests with stop_token_ids=() (otherwise generate's
    min_new_tokens would mask the config's EOS and the two would differ); tests with stops pass eos explicitly."""
    reference = copy.deepcopy(model)
    reference.generation_config.eos_token_id = None
    return reference


def make_prompts(count: int, low: int, high: int, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """`count` random prompts with lengths in [low, high]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def make_engine(model: torch.nn.Module, **config) -> Engine:
    """An Engine with a small explicit cache (tests never size from memory)."""
    config.setdefault("num_blocks", 256)
    config.setdefault("block_size", 4)
    return Engine(model, ContinuousBatchingConfig(**config))


def run_to_completion(engine: Engine) -> dict:
    """Step until idle; return final outputs by request id."""
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    return outputs


def make_scheduler(
    num_blocks: int = 32,
    block_size: int = 4,
    max_batch_tokens: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fifo",
    prefix_caching: bool = True,
    num_swap_blocks: int = 0,
) -> Scheduler:
    """A real scheduler over a real block manager; no model."""
    manager = BlockManager(num_blocks, block_size, prefix_caching, num_swap_blocks)
    return Scheduler(manager, max_batch_tokens, max_num_seqs, policy)


def make_request(
    request_id: str,
    prompt: list[int],
    max_new_tokens: int = 8,
    n: int = 1,
    stop_token_ids: tuple[int, ...] = (),
    **sampling,
) -> Request:
    """A Request as the engine would build it (group leader when n > 1)."""
    params = SamplingParams(stop_token_ids=stop_token_ids, max_new_tokens=max_new_tokens, **sampling)
    return Request(
        request_id=request_id if n == 1 else f"{request_id}#0",
        group_id=request_id,
        sample_index=0,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        sampling=params,
        max_new_tokens=max_new_tokens,
        stop_token_ids=frozenset(stop_token_ids),
        seed=params.seed or 0,
        arrival=0,
        num_forks=n - 1,
    )


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def no_leaked_blocks(monkeypatch):
    """Every engine a test builds (directly, through a manager or generate_batch) ends with all KV blocks free."""
    engines: list[Engine] = []
    original_init = Engine.__init__

    @functools.wraps(original_init)  # the signature and docstring stay Engine's (tests/test_api_reference.py)
    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", tracking_init)
    yield engines
    for engine in engines:
        engine.block_manager.check_all_free()


@pytest.fixture
def unknown_lengths(monkeypatch):
    """Admission as with lengths the scheduler cannot see (a real model's EOS): the growth ratio's estimate, which
    admits more than a small cache holds, and preempts. For tests that need preemption: their requests all end at
    max_new_tokens, and the scheduler would otherwise take it as their length and admit only what fits."""
    monkeypatch.setattr(GrowthReserve, "lengths_known", property(lambda self: False))


@pytest.fixture
def zero3(monkeypatch):
    """A fake DeepSpeed (`deepspeed.zero.GatheredParameters`) backed by a `FakeZero3` that partitions models."""
    fake = FakeZero3()
    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=fake.GatheredParameters)
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    monkeypatch.setitem(sys.modules, "deepspeed.zero", module.zero)
    return fake


def _call_on_a_roomy_stack(function, kwargs):
    __tracebackhide__ = True
    return function(**kwargs)


# CPython 3.11+ keeps frames on a data stack of 16 KiB chunks: a call that does not fit in the current chunk maps a
# new one, and its return unmaps it. A hot loop whose calls land on a chunk's edge maps and unmaps a chunk per call:
# the Triton interpreter's tests spent as long in page faults as in Python (tests/test_cuda_graphs.py: 39 s of
# system time in 75 s). A frame this large (2**17 stack slots, never touched) gets a 2 MiB chunk of its own, and the
# test's frames fill the free MiB after it without reaching an edge. Only where the frames live changes.
_call_on_a_roomy_stack.__code__ = _call_on_a_roomy_stack.__code__.replace(co_stacksize=1 << 17)


def pytest_collection_finish(session):
    """Start the Triton compile proof in the background, niced, once it is known to be among the tests to run: it
    then compiles on the cores the other tests leave idle (tests/kernel_compile_job.py). Under pytest-xdist, the
    controlling process started it, and its test processes read its results."""
    shared = getattr(session.config, "workerinput", {}).get("kernel_compile_dir")
    wanted = any(item.path.name == "test_kernel_compile.py" and "compiles" in item.name for item in session.items)
    if shared is not None:
        kernel_compile_job.attach(Path(shared))
    elif wanted and importlib.util.find_spec("triton") is not None:
        kernel_compile_job.start()
    # The garbage collector's full passes scan every object the process holds: torch's, transformers', each
    # module's fixtures. In the whole suite they cost about 1 s each, 100 s in all. What exists now is kept out of
    # them (frozen), and they run at most once per 50 passes of the middle generation instead of 10; the tests' own
    # garbage is still collected, cycles that reach the oldest generation a little later.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*gc.get_threshold()[:2], 50)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, once per test process it starts: the processes share one compile proof (above),
    started here when the run's paths include its tests."""
    compile_tests = Path(__file__).with_name("test_kernel_compile.py").resolve()
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in node.config.args] or [compile_tests.parent]
    covered = any(path == compile_tests or path in compile_tests.parents for path in paths)
    if covered and importlib.util.find_spec("triton") is not None:
        # Two test processes leave no idle core: the compile gets about two fifths of the machine (its group's
        # niceness 2 against the tests' 0) and ends before its test waits, instead of running on after them.
        node.workerinput["kernel_compile_dir"] = str(kernel_compile_job.start(group_nice=2))


def pytest_sessionfinish(session, exitstatus):
    kernel_compile_job.close()
    worker_zygote.close()
    gc.unfreeze()  # collectable again before the interpreter ends (nanobind reports what it finds still alive)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Every (plain) test function runs on a roomy stack (above)."""
    function = pyfuncitem.obj
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        return (yield)

    @functools.wraps(function)  # request.function still names and documents the test
    def on_a_roomy_stack(**kwargs):
        __tracebackhide__ = True
        return _call_on_a_roomy_stack(function, kwargs)

    pyfuncitem.obj = on_a_roomy_stack
    try:
        return (yield)
    finally:
        pyfuncitem.obj = function


@pytest.fixture(scope="session")
def agent_worker():
    """One rollout-worker serving the scripted tool caller (`--model tiny-agent`), shared by the agentic test modules;
    each trainer pushes its own script's weights (same architecture and vocabulary) before it samples."""
    from service_helpers import Worker

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        server = Worker("--model", "tiny-agent")
    yield server
    server.close()


@pytest.fixture(scope="session")
def http_worker():
    """One `rollout-worker --http` on the tiny model, shared by the HTTP modules that only send requests (its `url`)."""
    from service_helpers import Worker, free_port

    port = free_port()
    server = Worker("--http", f"127.0.0.1:{port}")
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.close()

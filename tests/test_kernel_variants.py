"""How many compiled Triton variants a nano-shaped rollout asks for, and that each decode-graph bucket is captured
once: GPU-free guards against recompilation storms (a launch argument that changes with the batch makes Triton
compile again mid-rollout, and on CUDA recapture).

The schedule is the nano benchmark workload's (256 prompts, prompt and output lengths random in 100-1024, its
engine settings) through the engine's Triton path, on a one-layer model with nano's attention geometry (16 query
heads over 8 KV heads) and a small head dim. The kernels' launches are recorded, each keyed with Triton's own
binder and cache key (`rollout.benchmarks.kernels.variants.specialize`), and not executed: Triton's interpreter takes
tens of milliseconds per program, hours for this schedule; a launch's arguments (hence its variant) do not depend
on the attention's values, and with greedy decoding, no stop tokens and fixed output lengths neither does the
schedule. The kernels' results are tested in tests/test_triton_attention.py and tests/test_cuda_graphs.py.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from test_parity import GREEDY  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from conftest import make_engine  # noqa: E402
from rollout.benchmarks.harness.workloads import WORKLOADS  # noqa: E402
from rollout.benchmarks.kernels.variants import KERNELS, Launch, as_jit_function, specialize  # noqa: E402
from rollout.engine.attention import triton_kernel as triton_attention  # noqa: E402
from rollout.engine.runner.cuda_graphs import DecodeGraphs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NANO = WORKLOADS["nano"]
# Most compiled variants (both kernels together) a rollout may ask for: each costs a compile (seconds) mid-rollout.
MAX_VARIANTS = 16


def nano_shaped_model() -> torch.nn.Module:
    """One layer with nano's heads (16 query heads over 8 KV heads: the same tiles and split counts) and head dim 16."""
    torch.manual_seed(0)
    geometry = {key: NANO.model_config[key] for key in ("num_attention_heads", "num_key_value_heads")}
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        head_dim=16,
        max_position_embeddings=NANO.model_config["max_position_embeddings"],
        **geometry,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Record every launch of both kernels; in place of running one, zero its output (args[3] of the attention
    kernel, args[0] of the merge), so the model computes on finite values."""
    launches: list[Launch] = []
    for name, out_index in zip(KERNELS, (3, 0)):

        def run(*args, grid, warmup, _name=name, _out=out_index, **kwargs):
            launches.append(Launch(_name, args, kwargs))
            args[_out].zero_()

        monkeypatch.setattr(getattr(triton_attention, name), "run", run)
    return launches


class Replay:
    """A captured graph's CPU stand-in: replaying runs the captured step again over the persistent buffers, into
    the output tensor the capture returned (as a CUDA graph's replay rewrites its captured outputs)."""

    def __init__(self, graphs: DecodeGraphs, size: int, logits: torch.Tensor, replays: collections.Counter):
        self.graphs, self.size, self.logits, self.replays = graphs, size, logits, replays

    def replay(self) -> None:
        self.replays[self.size] += 1
        self.logits.copy_(self.graphs._step(self.size))


def count_captures(
    monkeypatch: pytest.MonkeyPatch, graphs: DecodeGraphs
) -> tuple[collections.Counter, collections.Counter]:
    """Turn capture on with a CPU stand-in for its CUDA-only part (`_capture_one`: the eager first step, then the
    graph), keeping `capture` and `run`'s bookkeeping real; count captures and replays per bucket."""
    captures: collections.Counter = collections.Counter()
    replays: collections.Counter = collections.Counter()

    def capture_one(self: DecodeGraphs, size: int) -> None:
        captures[size] += 1
        self._pad(0, size)
        logits = self._step(size)  # the eager first run, where Triton compiles
        self._graphs[size] = (Replay(self, size, logits, replays), logits)

    monkeypatch.setattr(DecodeGraphs, "_capture_one", capture_one)
    if DEVICE.type == "cpu":  # capture() keeps the current CUDA stream across a capture: the CPU has none
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    graphs.capture_enabled = True
    return captures, replays


def test_nano_schedule_asks_for_few_variants_and_captures_each_bucket_once(monkeypatch):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(*NANO.prompt_len))] for _ in range(NANO.num_prompts)]
    budgets = [rng.randint(*NANO.output_len) for _ in prompts]
    block_size = NANO.engine_config["block_size"]
    # Blocks for every sequence at full length: the schedule is nano's, without preemption.
    num_blocks = sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, budgets))
    model = nano_shaped_model()
    engine = make_engine(model, **NANO.engine_config, num_blocks=num_blocks, attention_backend="triton")
    max_batch = min(NANO.engine_config["max_num_seqs"], NANO.engine_config["max_batch_tokens"])
    graphs = engine.runner.enable_decode_graphs(max_batch, engine.max_model_len, capture=False)
    captures, replays = count_captures(monkeypatch, graphs)
    launches = record_launches(monkeypatch)
    for index, (prompt, budget) in enumerate(zip(prompts, budgets)):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=budget)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.is_finished})
    engine.close()
    assert [len(finished[str(i)].generated_tokens) for i in range(len(prompts))] == budgets

    # The shape's character: decode batches crossing many buckets, eager (prefill and mixed) steps, split-K.
    assert len(captures) >= 6, captures
    variants = {(launch.kernel, specialize(launch)) for launch in launches}
    attention = [variant for kernel, variant in variants if kernel == KERNELS[0]]
    assert len({v.constexprs["BLOCK_M"] for v in attention}) >= 2, "decode and prefill tiles"
    query_lens = [set(launch.args[10].diff().tolist()) for launch in launches if launch.kernel == KERNELS[0]]
    assert any(1 in lens and max(lens) > 1 for lens in query_lens), "steps mixing decodes with prefill chunks"
    assert len({v.constexprs["NUM_SPLITS"] for v in attention}) >= 3, "split-K over several slice counts"

    keys = {(kernel, variant.key) for kernel, variant in variants}
    labels = sorted(variant.label for _, variant in variants)
    assert len(keys) <= MAX_VARIANTS, "\n".join(labels)

    # Each bucket captured once (its first step), then replayed: a second capture would show as a count of 2.
    assert all(count == 1 for count in captures.values()), captures
    assert set(replays) == set(captures) and sum(replays.values()) > 10 * len(captures), replays

    # The block table's row stride changes with the longest sequence in eager steps: were it specialized (1,
    # divisible by 16, other), the same launches would ask for more variants.
    attention_kernel = getattr(triton_attention, KERNELS[0])
    assert "stride_bt" in as_jit_function(attention_kernel).do_not_specialize
    specializing = triton.runtime.jit.JITFunction(attention_kernel.fn)
    specialized = {specialize(launch, specializing).key for launch in launches if launch.kernel == KERNELS[0]}
    assert len(specialized) > len(attention), "stride_bt specialization should add variants"

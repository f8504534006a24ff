"""The engine's host time per decode step: what the CPU spends on a step besides the model's forward and the
sampling kernels (scheduling, batch preparation, sampling-state preparation, output handling). On a GPU this work
must hide behind the device's decode step; for a small model that step takes a few milliseconds.

Measured with `running` sequences all decoding, sampled as GRPO samples them (temperature, top-p, top-k, a seed
each), or with every penalty and ban processor on as well (`processors="all"`): the model's forward is replaced by a
stub that returns ready logits, and the vocabulary is small (64 tokens). Decode steps go through the decode graphs'
persistent buffers, as on a GPU (without capturing: on a GPU a replay is one launch); on a GPU the sampler replays
its captured passes, as an engine there does. On CPU the sampling kernels still run on the host (on a GPU they are
queued): their time is measured apart, inside the sampler's torch operators, and taken out of the "host" figure.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.benchmarks.harness.stub_model import VOCAB, stub_model
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

STEPS = 100  # timed decode steps per measurement
WARM_STEPS = 5  # decode steps run before timing
PROMPT_TOKENS = 16
PHASES = ("schedule", "inputs", "sampling", "update")
HEADS_PER_KV = 2  # the stub model's query heads per KV head (the decode graphs' attention tile layout)
PROCESSORS = ("grpo", "all")
# Token 63 is a stop token that is also suppressed: min_new_tokens has a stop to mask, and no sequence ever stops.
_ALL_PROCESSORS = dict(
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    no_repeat_ngram_size=3,
    bad_words_ids=((10,), (5, 6), (7, 8, 9)),
    suppress_tokens=(11, 12, 63),
    begin_suppress_tokens=(13,),
    min_p=0.02,
    top_logprobs=5,
    stop_token_ids=(63,),
)


class _KernelClock(TorchDispatchMode):
    """Adds up the time spent inside torch operators (their kernels, on CPU run synchronously) while active, and
    counts the operators."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        start = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return result


def _operator_floor_seconds() -> float:
    """What a trivial operator costs inside `_KernelClock` (dispatch and allocation, no work to speak of): host
    time that a GPU does not hide either (it becomes the launch), so it is not counted as kernel time."""
    one = torch.zeros(1)
    with _KernelClock() as clock:
        for _ in range(200):
            one + 1  # noqa: B018 - timed for its cost only
    return clock.seconds / clock.calls


def _timed(phases: dict[str, float], name: str, function: Callable) -> Callable:
    """`function`, adding the seconds each call takes to phases[name]."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return timed


def _kernel_timed(kernel_seconds: list[float], function: Callable, operators: list[int]) -> Callable:
    """`function`, appending the seconds its torch operators work at each call to `kernel_seconds` (their time
    beyond what a trivial operator costs), and how many operators it called to `operators` (on a GPU, the launches
    and views each step costs the host)."""
    floor = _operator_floor_seconds()

    def timed(*args: Any, **kwargs: Any) -> Any:
        with _KernelClock() as clock:
            result = function(*args, **kwargs)
        kernel_seconds.append(max(0.0, clock.seconds - clock.calls * floor))
        operators.append(clock.calls)
        return result

    return timed


def _time_grammars(seconds: dict[str, float]) -> Callable[[], None]:
    """Add the time grammars take to `seconds`: "grammar_fill" (xgrammar's matchers filling the rows' token
    bitmasks: host work on any device), "grammar_apply" (the bitmask applied to the scores: a kernel on a GPU) and
    "grammar_accept" (matchers following the drawn tokens). Returns what undoes it."""
    from rollout.engine.grammar.constraints import Constrained, GrammarMasks

    originals = (GrammarMasks.fill, GrammarMasks.apply, Constrained.advance)
    GrammarMasks.fill = _timed(seconds, "grammar_fill", originals[0])
    GrammarMasks.apply = _timed(seconds, "grammar_apply", originals[1])
    Constrained.advance = _timed(seconds, "grammar_accept", originals[2])

    def restore() -> None:
        GrammarMasks.fill, GrammarMasks.apply, Constrained.advance = originals

    return restore


def host_time_per_step(
    running: int,
    device: str = "cpu",
    steps: int = STEPS,
    processors: str = "grpo",
    constraint: dict[str, Any] | None = None,
    tokenizer: Any = None,
    min_new_tokens_past_steps: bool = False,
) -> dict[str, float]:
    """The engine's host milliseconds per decode step with `running` sequences decoding, and where they go.

    Returns a dict of medians over `steps` decode steps: "step" (the whole step), "sampling_kernels" (the work of
    the sampler's torch operators beyond a trivial operator's cost: on CPU they run on the host, on a GPU they are
    queued and cost only their launch, so it is 0 there), "host" (step - sampling_kernels: the figure the goal is
    about), "sampling_operators" (torch operators the sampler calls a step, views included: on a GPU what its
    "sampling" time is made of), and the step's phases: "schedule" (scheduler), "inputs" (the model runner's batch preparation, the forward being a
    stub), "sampling" (the sampler, kernels included) and "update" (advance, fetch, resolve and outputs).

    Args:
        running: sequences decoding at once (one batch).
        device: where the engine runs ("cpu" or "cuda").
        steps: decode steps timed.
        processors: "grpo" (temperature, top-p, top-k and a seed) or "all" (those, and every penalty and ban
            processor, min_new_tokens, min_p and top log-probs as well).
        constraint: a structured-output constraint every sequence samples under (SamplingParams fields, e.g.
            {"json": schema}; it must not end within the steps), with `tokenizer`. The figures then add "grammar":
            the host time of the grammars (masks filled and applied, tokens accepted), a part of "host".
        tokenizer: the vocabulary the logits cover (None: the stub's 64 tokens).
        min_new_tokens_past_steps: min_new_tokens past every timed step, stop tokens masked throughout (with a
            constraint, each step's masks keep the rows off branches that end sooner: `grammar/length_goal.py`).
    """
    if processors not in PROCESSORS:
        raise ValueError(f"processors must be one of {PROCESSORS}, not {processors!r}")
    extra = _ALL_PROCESSORS if processors == "all" else {"stop_token_ids": ()}
    target = torch.device(device)
    kernel_steps = min(steps, 20) if device != "cuda" else 0
    # Every sequence decodes through the whole run without finishing and its blocks fit from the start: no step
    # measured here preempts or ends anything.
    decode_steps = WARM_STEPS + steps + kernel_steps
    max_new_tokens = decode_steps + 8
    blocks_per_sequence = -(-(PROMPT_TOKENS + max_new_tokens) // 16)
    vocab = VOCAB if tokenizer is None else len(tokenizer)
    engine = Engine(
        stub_model(vocab_size=vocab).to(target),
        ContinuousBatchingConfig(
            block_size=16,
            num_blocks=running * blocks_per_sequence,
            max_num_seqs=running,
            max_batch_tokens=max(running * 16, 2048),
            use_cuda_graph=False,
            overlap_scheduling=True,  # as on a GPU: step N+1 is scheduled before step N's tokens are on the host
        ),
        tokenizer=tokenizer,
    )
    logits = torch.randn(running, vocab, device=target)

    def forward(input_ids: torch.Tensor, positions: Any, metadata: Any, keep: torch.Tensor) -> torch.Tensor:
        return logits[: keep.numel()]  # ready logits: no model compute

    engine.runner._forward = forward  # noqa: SLF001 - the measurement leaves out exactly the model's forward
    engine.runner._decode_forward = forward  # noqa: SLF001
    # Decode steps take the path they take on a GPU: inputs copied into the decode graphs' persistent buffers, then a
    # replay. A replay is one launch: the captured work (attention plan, cache slots, the forward) costs the host
    # nothing per operator, so it runs once per batch size, as a capture does, and its output is reused.
    engine.runner.heads_per_kv = HEADS_PER_KV
    graphs = engine.runner.enable_decode_graphs(running, engine.max_model_len, capture=False)
    graphs._step = functools.cache(graphs._step)  # noqa: SLF001 - the replay of a captured step
    if device == "cuda":  # sampling replays captured passes, as in an engine whose decode steps replay graphs
        engine.sampler.enable_graphs(graphs.buckets)
    for index in range(running):
        fields = dict(
            do_sample=True,
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=index,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if processors == "all" or min_new_tokens_past_steps else 0,
            **extra,
        )
        sampling = SamplingParams(**{**fields, **(constraint or {})})  # (a constraint may bring min_new_tokens)
        engine.add_request(f"s{index}", [(index + k) % VOCAB for k in range(PROMPT_TOKENS)], sampling)
    while engine.scheduler.waiting or any(r.num_computed_tokens < PROMPT_TOKENS for r in engine.scheduler.running):
        engine.step()  # prefill: every prompt in the cache, every sequence decoding from here on

    def timed_step() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    for _ in range(WARM_STEPS):
        timed_step()
    phases = dict.fromkeys(PHASES, 0.0)  # the step being timed
    grammar = dict.fromkeys(("grammar_fill", "grammar_apply", "grammar_accept"), 0.0) if constraint else {}
    restore = _time_grammars(grammar) if constraint else None
    sample, schedule, run = engine.sampler.sample, engine.scheduler.schedule, engine.runner.run
    advance, resolve = engine.loop._advance, engine.loop._resolve  # noqa: SLF001 - timed through instance attributes
    engine.scheduler.schedule = _timed(phases, "schedule", schedule)
    engine.runner.run = _timed(phases, "inputs", run)
    engine.loop._advance = _timed(phases, "update", advance)  # noqa: SLF001
    engine.loop._resolve = _timed(phases, "update", resolve)  # noqa: SLF001
    operators: list[int] = []
    plain_sample, kernel_sample = (
        _timed(phases, "sampling", sample),
        _kernel_timed(kernel_seconds := [], sample, operators),
    )
    # The kernel steps are spread among the plain ones, so that both sample the machine in the same state (a
    # shared CPU's speed drifts by tens of percent within seconds).
    kernel_every = steps // kernel_steps if kernel_steps else 0  # on a GPU the sampler's kernels are queued
    step_times: list[float] = []
    phase_times: dict[str, list[float]] = {name: [] for name in PHASES}
    try:
        for index in range(steps):
            engine.sampler.sample = plain_sample
            step_times.append(timed_step())
            for name in PHASES:
                phase_times[name].append(phases[name])
                phases[name] = 0.0
            for name in grammar:
                phase_times.setdefault(name, []).append(grammar[name])
                grammar[name] = 0.0
            # (at most kernel_steps of them: the sequences' lengths are sized for that many)
            if kernel_every and index % kernel_every == 0 and len(kernel_seconds) < kernel_steps:
                engine.sampler.sample = kernel_sample
                engine.step()
                phases.update(dict.fromkeys(PHASES, 0.0))
                grammar.update(dict.fromkeys(grammar, 0.0))
        if not kernel_steps:  # on a GPU: one step counted apart (the kernels' times mean nothing there)
            engine.sampler.sample = kernel_sample
            engine.step()
    finally:
        if restore is not None:
            restore()
    decoding = len(engine.scheduler.running)
    preemptions = engine.scheduler.num_preemptions
    engine.close()
    if decoding != running or preemptions:
        raise RuntimeError(
            f"host time measurement invalid: {decoding} of {running} sequences still decoding, {preemptions} preemptions"
        )
    step_ms = statistics.median(step_times) * 1000
    kernels_ms = statistics.median(kernel_seconds) * 1000 if kernel_seconds else 0.0
    figures = {"step": step_ms, "sampling_kernels": kernels_ms, "host": step_ms - kernels_ms}
    figures.update({name: statistics.median(times) * 1000 for name, times in phase_times.items()})
    figures = {name: round(value, 3) for name, value in figures.items()}
    figures["sampling_operators"] = statistics.median(operators)
    return figures


def run_host_time(
    device: str = "cpu",
    sizes: tuple[int, ...] = (64, 256),
    processors: str = "grpo",
) -> dict[str, dict[str, float]]:
    """`host_time_per_step` at each number of running sequences (keys: the numbers, as strings).

    Args:
        device: where the engine runs ("cpu" or "cuda").
        sizes: the numbers of running sequences measured.
        processors: the sampling processors every sequence uses ("grpo" or "all", see `host_time_per_step`).
    """
    return {str(size): host_time_per_step(size, device, processors=processors) for size in sizes}

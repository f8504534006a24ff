"""The systems `rollout-bench throughput` compares, each measured in a process of its own (`isolated.py`): this
engine (with and without overlapped scheduling, under a JSON grammar, serving one or four LoRA adapters
unmerged, and batch-invariant), transformers' `generate_batch` (continuous batching) and `generate` (one left-padded static batch).

Every system decodes greedily with EOS ignored and must produce each request's own `max_new_tokens`; tokens/s counts
exactly those tokens (a static batch computes up to the longest, but only the requested tokens count). Each is warmed
up before its timer starts; every system gets the workload's KV budget in bytes.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import statistics
import time
from typing import Any

import torch

from rollout.benchmarks.harness.choices import SYSTEM_NAMES
from rollout.benchmarks.harness.progress import stage
from rollout.benchmarks.harness.workloads import GIB, WORKLOADS, Workload, make_workload
from rollout.benchmarks.throughput.device_profile import device_profile
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.generate import generate_batch, release_cached_engine
from rollout.presets.models import tiny_tokenizer

# PeftModels made by `with_adapters`, by base model (a benchmark process builds one).
_PEFT_MODELS: dict[torch.nn.Module, torch.nn.Module] = {}
# The untimed warm-up of transformers' systems: the first prompts, few tokens (kernels loaded, allocator warm).
WARMUP_PROMPTS, WARMUP_TOKENS = 8, 16
# rollout's warm-up also runs the requests with the longest outputs to their end: the long-context decode steps of
# few sequences are where attention splits its key blocks (kernel variants the full batch never asks for).
WARMUP_TAIL_REQUESTS = 8
# Profiled after their timed runs on a GPU (`device_profile.py`): every prompt, this many tokens each.
PROFILED, PROFILED_TOKENS = ("rollout", "rollout_invariant"), 16


def sync(device: str) -> None:
    """Wait for the device (a timer must not stop while work is still queued)."""
    if device == "cuda":
        torch.cuda.synchronize()


def run_rollout(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new: list[int],
    workload: Workload,
    warmup: bool = False,
    **overrides: Any,
) -> tuple[float, list[list[int]]]:
    """This engine, kept on the model between calls (its cache and captured graphs too): every prompt with its own
    max_new_tokens, greedy, EOS ignored. (seconds, tokens per prompt).

    Args:
        warmup: capture every decode graph before the timer starts (the first call with these settings).
        overrides: ContinuousBatchingConfig fields set on top of the workload's.
    """
    adapters = overrides.pop("adapters", 0)
    constraint = overrides.pop("constraint", {})
    config = ContinuousBatchingConfig(**{**workload.cache_config(), **overrides})
    sampling = [SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=m, **constraint) for m in max_new]
    chosen: dict[str, Any] = {"tokenizer": tiny_tokenizer()} if constraint else {}
    if adapters:  # the prompts take the adapters in turn, all in one batch
        model = with_adapters(model, adapters)
        chosen["adapter"] = [f"lora{index % adapters}" for index in range(len(prompts))]
    if warmup:
        one_token = dict(max_new_tokens=1, progress_bar=False, persistent_manager=True, warmup=True)
        first = {"adapter": chosen["adapter"][:1]} if adapters else {}
        generate_batch(model, prompts[:1], continuous_batching_config=config, **one_token, **first)
    sync(workload.device)
    start = time.perf_counter()
    outputs = generate_batch(
        model,
        prompts,
        continuous_batching_config=config,
        progress_bar=False,
        sampling=sampling,
        persistent_manager=True,
        warmup=False,
        **chosen,
    )
    sync(workload.device)
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def run_rollout_sequential(model, prompts, max_new, workload: Workload, warmup: bool = False):
    """This engine with overlapped scheduling off: each step is scheduled after the last one's tokens reached the
    host (what overlap gains is the difference)."""
    return run_rollout(model, prompts, max_new, workload, warmup, overlap_scheduling=False)


def with_adapters(model: torch.nn.Module, count: int, rank: int = 16) -> torch.nn.Module:
    """The model as a PeftModel with `count` random LoRA adapters "lora0"... (rank `rank` on every Linear layer),
    made once per model (the engine serves them unmerged, side by side)."""
    from peft import LoraConfig, get_peft_model

    if model not in _PEFT_MODELS:
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        peft_model = get_peft_model(model, config, adapter_name="lora0")
        for index in range(1, count):
            peft_model.add_adapter(f"lora{index}", config)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=1e-3)
        _PEFT_MODELS[model] = peft_model
    return _PEFT_MODELS[model]


def run_rollout_lora1(model, prompts, max_new, workload: Workload, warmup: bool = False):
    """This engine serving one LoRA adapter (r=16, every Linear layer) unmerged for every prompt."""
    return run_rollout(model, prompts, max_new, workload, warmup, adapters=1)


def run_rollout_lora4(model, prompts, max_new, workload: Workload, warmup: bool = False):
    """This engine serving four LoRA adapters unmerged, the prompts taking them in turn in one batch."""
    return run_rollout(model, prompts, max_new, workload, warmup, adapters=4)


def run_rollout_invariant(model, prompts, max_new, workload: Workload, warmup: bool = False):
    """This engine with `batch_invariant=True` (every token computed bit for bit as the trainer's invariant forward
    computes it: on a GPU its Triton kernels, decode steps replayed from CUDA graphs); the price of the mode is its
    ratio to `rollout`."""
    invariant = {"batch_invariant": True, "attention_backend": "torch"}
    return run_rollout(model, prompts, max_new, workload, warmup, decode_compile_config=None, **invariant)


def run_transformers_generate_batch(
    model, prompts, max_new, workload: Workload, deadline: float | None = None
) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching manager, each request with its own max_new_tokens, with our cache size in
    bytes (as many pages of our block size), token budget and batch width.

    Args:
        deadline: a `time.monotonic()` at which to stop (cut short): requests not finished by then come back empty.
    """
    from transformers import ContinuousBatchingConfig as TransformersConfig
    from transformers import GenerationConfig

    from rollout.transformers_configs import page_size_field

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(max_new), eos_token_id=-1)
    engine = workload.cache_config()
    settings = dict(
        max_batch_tokens=engine["max_batch_tokens"],
        max_requests_per_batch=engine["max_num_seqs"],
        num_blocks=engine["num_blocks"],
    )
    settings[page_size_field()] = engine["block_size"]
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=TransformersConfig(**settings)
    )
    sync(workload.device)
    start = time.perf_counter()
    manager.start()
    results = {}
    try:
        for index, (prompt, count) in enumerate(zip(prompts, max_new)):
            manager.add_request(prompt, request_id=f"req_{index}", max_new_tokens=count)
        stalled_at = time.monotonic() + 600
        while len(results) < len(prompts) and (deadline is None or time.monotonic() < deadline):
            # Short polls: a generation thread that died (an error inside transformers) is reported at once rather
            # than waited on; a live one that stops producing is given 600 s.
            output = manager.get_result(timeout=1)
            if output is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped (see its log above) before finishing")
                if time.monotonic() > stalled_at:
                    raise RuntimeError("transformers generate_batch produced no result within 600 s")
                continue
            stalled_at = time.monotonic() + 600
            if output.is_finished():
                results[output.request_id] = output.generated_tokens
        sync(workload.device)
        elapsed = time.perf_counter() - start  # before the stop: a cut run is timed up to its deadline
    finally:
        # A run cut short stops at once: the default stop finishes every pending request first (measured on an
        # H200: past the section's limit, so nothing was reported).
        manager.stop(block=True, **_hard_stop(manager, len(results) < len(prompts)))
    return elapsed, [results.get(f"req_{i}", []) for i in range(len(prompts))]


def _hard_stop(manager: Any, unfinished: bool) -> dict[str, bool]:
    """`stop`'s keyword that fails the pending requests at once, when some are pending and transformers has it."""
    return {"hard_stop": True} if unfinished and "hard_stop" in inspect.signature(manager.stop).parameters else {}


def run_transformers_generate(
    model, prompts, max_new, workload: Workload, deadline: float | None = None
) -> tuple[float, list[list[int]]]:
    """transformers' `generate` on one left-padded static batch up to the longest max_new_tokens.

    Args:
        deadline: a `time.monotonic()` at which to stop (its `max_time`): every row then has the tokens decoded so
            far, up to its own max_new_tokens.
    """
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=workload.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=workload.device)
    longest = max(max_new)
    limit = {} if deadline is None else {"max_time": max(0.1, deadline - time.monotonic())}
    sync(workload.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            **limit,
        )
    sync(workload.device)
    elapsed = time.perf_counter() - start
    return elapsed, [output[i, width : width + m].tolist() for i, m in enumerate(max_new)]


# Greedy JSON under a grammar that never ends before a request's length (cpu-small's tiny model and tokenizer).
ENDLESS_JSON = {"type": "array", "items": {"type": "string"}, "minItems": 1000}


def run_rollout_json(model, prompts, max_new, workload: Workload, warmup: bool = False):
    """This engine with every request under a JSON-schema grammar (structured outputs): what the grammar costs is
    the difference from `rollout` (the tokens differ: the grammar picks them)."""
    return run_rollout(model, prompts, max_new, workload, warmup, constraint={"json": ENDLESS_JSON})


# Systems that stop at a deadline and return what they finished (a baseline cut short reports that; rollout's own
# systems are not cut: past their time limit they are a timeout).
STOP_AT_DEADLINE = ("transformers_generate_batch", "transformers_generate")

# By name (choices.SYSTEM_NAMES, which the parser offers without loading this module): each is `run_<name>` above.
SYSTEMS = {name: globals()[f"run_{name}"] for name in SYSTEM_NAMES}


def warm_up(system: str, model: torch.nn.Module, prompts: list[list[int]], max_new: list[int], workload: Workload):
    """The system's untimed warm-up. rollout: every decode graph captured, then every prompt prefilled (each
    prefill shape's kernels) and the longest requests run to their end (the long-context decode kernels); the
    engine, its cache and graphs are kept for the timed runs. transformers: its first prompts, a few tokens each."""
    if system.startswith("rollout"):
        SYSTEMS[system](model, prompts, [min(m, 2) for m in max_new], workload, warmup=True)
        longest = sorted(range(len(prompts)), key=lambda index: -max_new[index])[:WARMUP_TAIL_REQUESTS]
        SYSTEMS[system](model, [prompts[i] for i in longest], [max_new[i] for i in longest], workload)
    else:
        count = min(WARMUP_PROMPTS, len(prompts))
        SYSTEMS[system](model, prompts[:count], [min(m, WARMUP_TOKENS) for m in max_new[:count]], workload)


def token_digest(tokens: list[int]) -> str:
    """A short fingerprint of one completion (systems compare completions across processes by it)."""
    return hashlib.sha1(str(tokens).encode()).hexdigest()[:12]


def measure_system(
    system: str,
    workload: str,
    seed: int = 0,
    repeats: int = 1,
    warmup: bool = True,
    num_prompts: int | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Warm `system` up, then time it on the workload (`isolated.py` runs this in a process of its own).

    Args:
        system: a key of SYSTEMS.
        workload: a key of WORKLOADS.
        seed: model and prompt seed.
        repeats: timed runs; the median is reported.
        warmup: run the warm-up first (off: first-call costs are timed).
        num_prompts: run the workload's first requests only.
        deadline: a `time.monotonic()` value (one clock for every process of the machine: a parent sets it) at
            which a system of `STOP_AT_DEADLINE` stops its timed run and reports what it finished (`cut_short`);
            None: no limit.
    Returns:
        tokens_per_s, seconds (median), runs_s, warmup_s, kv_budget_bytes, peak_memory_gib (CUDA), a digest of each
        completion, `profile` (rollout's systems on a GPU: `device_profile` of a shorter run, else None), and for a
        run cut short `cut_short`: the requests it finished of those it was given, and the
        tokens counted of those requested (up to each request's max_new_tokens: `generate` returns every row's tokens
        so far, `generate_batch` its finished requests only, so its rate is then a lower bound).
    """
    chosen = WORKLOADS[workload]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    stage(f"{system}: building the {workload} model and prompts")
    model, prompts, max_new = make_workload(chosen, seed)
    prompts, max_new = prompts[:num_prompts], max_new[:num_prompts]
    started = time.perf_counter()
    if warmup:
        stage(f"{system}: warm-up")
        warm_up(system, model, prompts, max_new, chosen)
    warmup_s = time.perf_counter() - started
    if chosen.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    limit = {"deadline": deadline} if deadline is not None and system in STOP_AT_DEADLINE else {}
    times, cut_short = [], None
    for repeat in range(repeats):
        stage(f"{system}: run {repeat + 1} of {repeats}, {len(prompts)} prompts, {sum(max_new)} tokens")
        elapsed, tokens = SYSTEMS[system](model, prompts, max_new, chosen, **limit)
        lengths = [min(len(t), m) for t, m in zip(tokens, max_new)]
        if lengths != max_new:
            if not limit or time.monotonic() < deadline:
                raise RuntimeError(f"{system} did not produce the requested lengths")
            cut_short = {
                "finished_requests": sum(n == m for n, m in zip(lengths, max_new)),
                "requests": len(prompts),
                "tokens": sum(lengths),
                "requested_tokens": sum(max_new),
            }
            stage(f"{system}: cut short at its deadline after {elapsed:.2f} s: {cut_short}")
            times = [elapsed]  # the cut run alone is reported: its rate is over what it finished
            break
        stage(f"{system}: {elapsed:.2f} s")
        times.append(elapsed)
    peak = torch.cuda.max_memory_allocated() / GIB if chosen.device == "cuda" else None  # of the timed runs
    profiled = None
    if chosen.device == "cuda" and system in PROFILED and cut_short is None:  # where a GPU figure's time went
        stage(f"{system}: profiling {PROFILED_TOKENS} tokens of every prompt")
        shorter = [min(m, PROFILED_TOKENS) for m in max_new]
        try:  # the timed figures stand without it
            profiled = device_profile(lambda: SYSTEMS[system](model, prompts, shorter, chosen), "cuda")
        except Exception as error:  # noqa: BLE001 - reported in the profile's place
            profiled = {"error": repr(error)[-500:]}
    release_cached_engine(model)
    seconds = statistics.median(times)
    counted = cut_short["tokens"] if cut_short else sum(max_new)
    return {
        "workload": workload,
        "generated_tokens": counted,  # what a run cut short finished (`cut_short` has what it was asked for)
        "tokens_per_s": round(counted / seconds, 1),
        "seconds": round(seconds, 3),
        "runs_s": [round(t, 3) for t in times],
        "warmup_s": round(warmup_s, 1),
        "kv_budget_bytes": chosen.kv_budget_bytes(),
        "peak_memory_gib": None if peak is None else round(peak, 2),
        "cut_short": cut_short,
        "token_digests": [token_digest(t) for t in tokens],
        "profile": profiled,
    }

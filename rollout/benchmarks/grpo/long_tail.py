"""`rollout-bench long-tail`: reasoning-GRPO lengths with a KV cache far smaller than the work.

Every prompt (100-1000 tokens, uniform) is sampled n times; each sample gets its own length, lognormal with the given
median and sigma, capped at --max-tokens, and generates exactly that many tokens: every sample is its own request (n=1,
its group's prompt) with max_new_tokens at the cap, as a trainer sends it, and ends with a stop token at its length
(the stop token is banned until then through min_new_tokens, and biased by +100 from there on through logit_bias). So
the scheduler knows no sample's length in advance, as with a real model's EOS.

The prefix cache still shares a group's prompt blocks between its samples once one of them computed them (samples admitted
in the same step as the first compute the prompt themselves; `first_admission_prefix_hit_tokens` says how much was
shared). The cache gets `--cache-fraction` of the peak demand, defined as the sum over samples of each sample's own
blocks, ceil((prompt + length) / block_size) (a group's prompt counted once per sample). So preemption (recompute, or
swap with --cpu-offload-space) is the normal state.

--model stub (default: 128 prompts x n=8, median 2048, cap 16384): the model's forward is replaced by ready logits
over a 64-token vocabulary, as in `host_time`, so a run costs the engine's own host work only. --model tiny (16 x 4,
median 150, cap 1200, prompts 20-200): the built-in tiny model, computed for real, on the CPU or (`--device cuda`)
a GPU, where decode steps and drafted steps replay CUDA graphs. --model nano (tiny's shape, `--device cuda` only): the
Qwen3-0.6B architecture in bf16, random weights.

Figures:
- recomputed_tokens = computed - (first_admission_prompt_tokens + generated - samples_with_output), where computed is
  the engine's `counters.computed_tokens` (every token run through the model: prefill chunks and decodes),
  first_admission_prompt_tokens the sum over samples of prompt - prefix-cache hit at its first admission, and
  generated - samples_with_output the decodes a sample needs (each generated token but the last is fed back once):
  the tokens computed beyond a run without preemption. Its ratio to generated tokens is `recompute_ratio`.
  `recomputed_tokens_by_position` counts the same from the batches (tokens at positions the sample had computed
  already): the two agree when the counters do.
- mean_decoding_per_step: sequences that computed exactly one token, averaged over the engine's steps.
- last_over_median_finish: the last sample's finish time over the median sample's, both from the start of the run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from rollout.benchmarks.grpo.long_tail_flags import TIME_BUDGET_S, shape_from
from rollout.benchmarks.grpo.long_tail_probe import Probe, stub_forward
from rollout.benchmarks.grpo.long_tail_speculative import compare, print_comparison
from rollout.benchmarks.grpo.long_tail_table import print_table
from rollout.benchmarks.grpo.long_tail_workload import build_model, make_workload, submit, vocab_size
from rollout.benchmarks.harness.progress import stage
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import ContinuousBatchingConfig
from rollout.engine.engine import Engine
from rollout.engine.scheduling.block_manager import cdiv

BLOCK_SIZE = 16


def measure(
    prompts: list[list[int]],
    lengths: list[list[int]],
    model: str = "stub",
    max_tokens: int | None = None,
    cache_fraction: float = 0.27,
    cpu_offload_space: float = 0.0,
    scheduler: str = "fifo",
    max_num_seqs: int = 256,
    seed: int = 0,
    time_budget_s: float = TIME_BUDGET_S,
    progress: bool = True,
    speculative: str | None = None,
    entropy: float | None = None,
    num_speculative_tokens: int = 4,
    speculative_disable_by_batch_size: int = ContinuousBatchingConfig.speculative_disable_by_batch_size,
    known_lengths: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run every sample to its length on an engine with `cache_fraction` of the peak demand; return the figures.

    Args:
        prompts, lengths: from `make_workload`.
        model: "stub" (forward stubbed), "tiny" (the built-in tiny model) or "nano" (the Qwen3-0.6B architecture).
        max_tokens: every sample's max_new_tokens, the cap (None: the longest length).
        cache_fraction: KV blocks as a fraction of the peak demand.
        cpu_offload_space: swap space in GiB (0: preempted samples are recomputed).
        scheduler: scheduler_type.
        max_num_seqs: most sequences per step.
        seed: sampling seed.
        time_budget_s: the run stops this long after the call, its model, engine and warm-up included (figures
            then say what did not finish).
        progress: show a progress bar on stderr.
        speculative: the engine's `speculative` setting (None: off).
        num_speculative_tokens: the most draft tokens per sample and step.
        speculative_disable_by_batch_size: drafts only in steps decoding at most this many samples.
        known_lengths: each sample's max_new_tokens is its length (the scheduler sees it), instead of a stop token
            pushed up by logit_bias at its length (which cannot outweigh a low-entropy head's logits).
        entropy: the model's head scaled to this mean next-token entropy, in nats (None: as built; not the stub's).
        device: where the model runs ("cpu" or "cuda"; on cuda decode and drafted steps replay CUDA graphs).
    """
    # The budget covers the set-up too (model, entropy scaling, engine, graph capture: seconds on a GPU): a caller
    # that shares out its time (`compare`, gpu-report's speculative section) must not be overrun by it.
    stop_at = time.perf_counter() + time_budget_s
    own = [cdiv(len(prompt) + length, BLOCK_SIZE) for prompt, group in zip(prompts, lengths) for length in group]
    max_tokens = max_tokens or max(map(max, lengths))
    # Every sample asks for max_tokens, so the longest prompt at the cap must fit alone (the engine checks it).
    longest = cdiv(max(map(len, prompts)) + max_tokens - 1, BLOCK_SIZE)
    num_blocks = max(math.ceil(cache_fraction * sum(own)), longest)
    max_len = max(map(len, prompts)) + max_tokens
    stop_token = vocab_size(model) - 1
    net = build_model(model, seed, device, max_len)
    if entropy is not None:
        scale_to_entropy(net, prompts[:8], entropy)
    config = ContinuousBatchingConfig(
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        scheduler_type=scheduler,
        max_num_seqs=max_num_seqs,
        cpu_offload_space=cpu_offload_space,
        use_cuda_graph=device == "cuda",
        seed=seed,
        speculative=speculative,
        **(dict(num_speculative_tokens=num_speculative_tokens,
                speculative_disable_by_batch_size=speculative_disable_by_batch_size) if speculative else {}),
    )  # fmt: skip
    engine = Engine(net, config)
    if model == "stub":
        stub_forward(engine, config.max_num_seqs)
    elif device == "cuda":  # graphs captured and kernels compiled before the clock starts
        engine.warmup()
    probe = Probe(engine)
    expected = submit(engine, prompts, lengths, max_tokens, stop_token, seed, known_lengths)
    stage(
        f"long-tail {model}: {len(prompts)} prompts x n={len(lengths[0])}, {sum(expected.values())} tokens to "
        f"generate, {num_blocks} KV blocks = {num_blocks / sum(own):.3f} of the peak demand ({sum(own)} blocks)"
    )
    finished: dict[str, tuple[float, str, int]] = {}  # request id -> (seconds from start, finish reason, tokens)
    start = time.perf_counter()
    interrupted = False
    try:
        with tqdm(total=len(expected), desc=f"long-tail {model}", unit="sample", file=sys.stderr, mininterval=5,
                  disable=not progress) as bar:  # fmt: skip
            while engine.has_unfinished() and time.perf_counter() < stop_at:
                try:
                    outputs = engine.step()
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop as at the budget, report what finished
                    interrupted = True
                    break
                for output in outputs:
                    if output.is_finished:
                        reason, tokens = output.finish_reason, len(output.generated_tokens)
                        finished[output.request_id] = (output.lifespan[1] - start, reason, tokens)
                        bar.update(1)
                        bar.set_postfix(
                            tokens=engine.counters.generated_tokens,
                            preempted=engine.scheduler.num_preemptions,
                            refresh=False,
                        )
        wall = time.perf_counter() - start
        probe.close_step()
        queues = engine.scheduler.running + list(engine.scheduler.swapped) + list(engine.scheduler.waiting)
        with_output = sum(1 for r in queues if r.num_output_tokens > 0)
        with_output += sum(1 for _, _, tokens in finished.values() if tokens)
        stats, computed = engine.stats(), engine.counters.computed_tokens
        verification_draws = engine.counters.verification_draws
        overlap_lost_steps = engine.counters.overlap_lost_steps
        drafted_wait_ms = _ms(engine.counters.drafted_wait_s, engine.counters.drafted_steps)
        block_bytes = engine.kv_cache.shape.bytes_per_block(BLOCK_SIZE, engine.kv_cache.kv.dtype)
        swap_blocks = engine.kv_cache.num_swap_blocks
    finally:
        engine.close()
    stage(f"long-tail {model}: {len(finished)} of {len(expected)} samples finished in {wall:.1f} s")
    generated = stats["generated_tokens"]
    accepted = stats.get("accepted_draft_tokens", 0)
    # Drafts the verification rejected were computed for nothing, but not recomputed: they are left out.
    recomputed = computed - (probe.draft_tokens - accepted) - (probe.first_admission_tokens + generated - with_output)
    times = sorted(seconds for seconds, _, _ in finished.values())
    complete = len(finished) == len(expected)
    return {
        "benchmark": "long-tail",
        "model": model,
        "device": device,
        "prompts": len(prompts),
        "n": len(lengths[0]),
        "samples": len(expected),
        "scheduler": scheduler,
        "max_num_seqs": config.max_num_seqs,
        "max_batch_tokens": config.max_batch_tokens,
        "block_size": BLOCK_SIZE,
        "peak_demand_blocks": sum(own),
        "peak_demand_definition": "sum over samples of ceil((prompt + length) / block_size)",
        "num_blocks": num_blocks,
        "cache_fraction": round(num_blocks / sum(own), 4),
        "cache_holds_samples": round(num_blocks / statistics.mean(own), 1),  # at their full length, on average
        "tokens_to_generate": sum(expected.values()),
        "prompt_tokens": sum(len(p) * len(group) for p, group in zip(prompts, lengths)),
        "generated_tokens": generated,
        "computed_tokens": computed,
        "prefill_tokens": stats["prefill_tokens"],
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
        "first_admission_prompt_tokens": probe.first_admission_tokens,
        "first_admission_prefix_hit_tokens": probe.first_admission_hits,
        "recomputed_tokens": recomputed,
        "recomputed_tokens_by_position": probe.recomputed_by_position,
        "recompute_ratio": round(recomputed / max(generated, 1), 4),
        "recompute_definition": "computed - (first-admission prompt tokens + generated - samples with output)",
        "readmissions": probe.readmissions,
        "readmission_tokens": probe.readmission_tokens,
        "readmission_prefix_hit_tokens": probe.readmission_hits,
        "max_admissions_per_sample": probe.max_admissions,
        "preemptions": stats["preemptions"],
        "preemptions_swapped": stats["preemptions_swapped"],
        "swap_out_blocks": probe.swap_out_blocks,
        "swap_in_blocks": probe.swap_in_blocks,
        "swap_out_bytes": probe.swap_out_blocks * block_bytes,
        "swap_in_bytes": probe.swap_in_blocks * block_bytes,
        "swap_space_blocks": swap_blocks,
        "kv_block_bytes": block_bytes,
        "steps": stats["steps"],
        "speculative": speculative,
        "entropy": entropy,
        "draft_tokens": probe.draft_tokens,
        "accepted_draft_tokens": accepted,
        "verification_draws": verification_draws,
        "overlap_lost_steps": overlap_lost_steps,
        "drafted_wait_ms": drafted_wait_ms,
        "tail_steps": probe.tail_steps,
        "tail_tokens": probe.tail_tokens,
        "tail_forwards_per_token": round(probe.tail_rows / max(probe.tail_tokens, 1), 4),
        "tail_ms_per_token": _ms(probe.tail_plain_s + probe.tail_drafted_s, probe.tail_tokens),
        "tail_plain_steps": probe.tail_plain_steps,
        "tail_plain_step_ms": _ms(probe.tail_plain_s, probe.tail_plain_steps),
        "tail_drafted_steps": probe.tail_drafted_steps,
        "tail_drafted_step_ms": _ms(probe.tail_drafted_s, probe.tail_drafted_steps),
        "tokens_per_s": round(generated / max(wall, 1e-9), 1),
        "host_s": round(probe.step_s - probe.forward_s, 3) if device == "cpu" else None,
        "mean_decoding_per_step": round(probe.decoding / max(probe.steps, 1), 1),
        "mean_sequences_per_step": round(probe.sequences / max(probe.steps, 1), 1),
        "mean_running_per_step": round(probe.running / max(probe.steps, 1), 1),
        "queued_steps": probe.queued_steps,
        "mean_decoding_while_queued": round(probe.queued_decoding / max(probe.queued_steps, 1), 1),
        "median_finish_s": round(statistics.median(times), 3) if complete else None,
        "last_finish_s": round(times[-1], 3) if complete else None,
        "last_over_median_finish": round(times[-1] / statistics.median(times), 2) if complete else None,
        "finished": complete,
        "samples_finished": len(finished),
        "samples_errored": sum(1 for _, reason, _ in finished.values() if reason == "error"),
        "samples_off_length": sum(1 for rid, (_, _, tokens) in finished.items() if tokens != expected[rid]),
        "wall_s": round(wall, 2),
        "time_budget_s": round(time_budget_s, 2),
        **({"interrupted": True} if interrupted else {}),  # `rollout-bench` exits 130 after printing it
    }


def _ms(seconds: float, count: int) -> float | None:
    """Milliseconds per one of `count` (None when there are none)."""
    return round(1000 * seconds / count, 4) if count else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload from the flags, measure it (with --speculative: without and with, side by side), print the
    table; returns the JSON-able summary."""
    shape = shape_from(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("rollout-bench long-tail: --device cuda, but torch sees no CUDA GPU here")
    vocab = vocab_size(args.model) - 1  # the last token is the stop token
    prompts, lengths = make_workload(shape, args.seed, vocab)

    def measure_one(speculative: str | None, time_budget_s: float) -> dict[str, Any]:
        summary = measure(
            prompts,
            lengths,
            model=args.model,
            max_tokens=shape.max_tokens,
            cache_fraction=args.cache_fraction,
            cpu_offload_space=args.cpu_offload_space,
            scheduler=args.scheduler,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            time_budget_s=time_budget_s,
            speculative=speculative,
            entropy=args.entropy,
            num_speculative_tokens=args.num_speculative_tokens,
            speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
            known_lengths=args.known_lengths,
            device=args.device,
        )
        summary.update(median_tokens=shape.median_tokens, max_tokens=shape.max_tokens, sigma=shape.sigma)
        summary["prompt_tokens_range"] = list(shape.prompt_tokens)
        return summary

    if args.speculative is None:
        summary = measure_one(None, args.time_budget)
        print_table(summary)
        return summary
    summary = compare(measure_one, args.speculative, args.repeats, args.time_budget)
    if summary["with"] is None:  # interrupted in the first run without drafts
        print_table(summary["without"])
        return {"benchmark": "long-tail", "speculative": args.speculative, **summary}
    print_table(summary["with"])
    print_comparison(summary)
    return {"benchmark": "long-tail", "speculative": args.speculative, **summary}

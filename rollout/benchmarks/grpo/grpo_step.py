"""`rollout-bench grpo-step`: whole GRPO steps (generation + rewards + loss + optimizer step) of the main job
(`examples/grpo_toy.py`: the tiny model, the letters-only task, 16 rows of 8 samples per step, 16 new tokens),
one system at a time, each in its own process, through TRL's own GRPOTrainer:

- `rollout_colocate`: `RolloutGRPOTrainer(rollout_mode="colocate", sleep_between_rounds=True)`: the engine in the
  trainer's process on the trainer's model, nothing pushed;
- `rollout_server`: `RolloutGRPOTrainer(rollout_workers=...)` with a rollout-worker on the same device (started by
  the benchmark; on CPU it gets one thread), weights pushed every step;
- `trl_generate`: `GRPOTrainer` with `use_vllm=False`: transformers' `generate`;
- `trl_generate_batch`: `GRPOTrainer` with `use_transformers_continuous_batching=True`: transformers'
  `generate_batch`.

Per system: the median seconds per step over the timed steps (after untimed warm-up steps), split into generation
(TRL's `_generate_single_turn` without the weight sync inside it), weight sync (`sync_weights`: the push in server
mode, nothing to send colocated) and training (the rest: rewards, logprob recomputation, loss, backward, optimizer
step); and peak memory (CUDA: the trainer's peak allocated bytes; CPU: the trainer process's peak RSS, plus the
worker's for server mode).

With `--max-staleness 0,1,2`, `rollout_server` runs once per staleness bound instead (`RolloutGRPOTrainer(...,
max_staleness=k)`: the next k rounds generate on the worker while the trainer trains): seconds per step, the
trainer's wait for rollouts per step, completion tokens trained per second, and the policy lag (mean and max over
the timed steps' tokens).

With `--partial-rollouts`, rollout_server runs on the long-tail shape (`rollout.benchmarks.grpo.grpo_long_tail`: each
group's length lognormal, median 32, capped at 256, forced by banning EOS until then; 4 groups of 8 per step) three times: synchronous
(`max_staleness=0`), asynchronous (`max_staleness=1`), and with partial rollouts (`max_staleness=1,
partial_rollouts=True`: a round trains the first complete groups, stragglers join the next round). Same columns, and
the groups carried over per step.

GPU recipe: `rollout-bench grpo-step --device cuda` runs the same comparison on one GPU (worker and trainer share it);
asynchronous generation pays off when the worker has a device of its own (`--max-staleness 0,1,2` with the worker on
a second GPU: `CUDA_VISIBLE_DEVICES` of the two processes), since on one device the two contend for it.
"""

from __future__ import annotations

from typing import Any

SYSTEMS = ("rollout_colocate", "rollout_server", "trl_generate", "trl_generate_batch")
# Also measurable (not run by default): rollout_colocate without TRL's importance-sampling correction, whose extra
# no-grad forward over every completion (old_per_token_logps, which TRL's vLLM path always computes) is most of
# what a colocated step's training part costs beyond TRL's plain `generate` path; and rollout_colocate with
# `batch_invariant=True`, which keeps the correction and skips that forward (its values are the rollout's, bit for bit).
EXTRA_SYSTEMS = ("rollout_colocate_no_is", "rollout_colocate_invariant")
STEPS, WARMUP_STEPS = 5, 2
KV_BLOCKS = 512  # the main job's worker cache (512 blocks of 16 tokens), for both rollout systems
# Policy shapes: the main job's tiny model, or the Qwen3-0.6B architecture in bf16 mixed precision with 256 new
# tokens per sample (the nano workload's model in a GRPO step).
MODEL_SHAPES = {
    "tiny": dict(),
    "nano": dict(bf16=True, max_completion_length=256, per_device_train_batch_size=32, learning_rate=1e-6),
}
COLOCATED_KV_BLOCKS = {"tiny": KV_BLOCKS, "nano": 2048}  # nano: 32 rows of up to ~300 tokens, several times over
SYSTEM_TIMEOUT_S = 540.0


def run(
    systems: list[str] | None = None,
    device: str | None = None,
    steps: int = STEPS,
    max_staleness: list[int] | None = None,
    model: str = "tiny",
    partial_rollouts: bool = False,
) -> dict:
    """Each system in its own process (its result printed as one JSON line as it finishes); print the table and
    return the JSON-able summary (`rollout-bench` prints it).

    Args:
        systems: which to run (default: all four, in the order of `SYSTEMS`).
        device: "cpu" or "cuda" (default: cuda when available).
        steps: timed steps per system (after `WARMUP_STEPS` untimed ones).
        max_staleness: run rollout_server once per bound instead (systems is then ignored).
        model: the policy's shape, a key of MODEL_SHAPES.
        partial_rollouts: run rollout_server on the long-tail shape: synchronous, max_staleness=1, and
            max_staleness=1 with partial rollouts (systems and max_staleness are then ignored).
    """
    import torch

    from rollout.benchmarks.harness.isolated import run_system
    from rollout.benchmarks.harness.progress import stage

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {}
    runs = [(system, 0, False, system) for system in systems or SYSTEMS]
    if max_staleness is not None:
        runs = [("rollout_server", k, False, f"rollout_server k={k}") for k in max_staleness]
    if partial_rollouts:
        runs = [("rollout_server", 0, False, "sync k=0"), ("rollout_server", 1, False, "async k=1")]
        runs.append(("rollout_server", 1, True, "partial k=1"))
    for system, k, partial, name in runs:
        stage(f"grpo-step: {name} ({WARMUP_STEPS} + {steps} steps on {device}, {model} model)")
        options = dict(device=device, steps=steps, warmup=WARMUP_STEPS, max_staleness=k, model=model)
        if partial_rollouts:
            options.update(partial=partial, long_tail=True)
        result = run_system("grpo-step", system, options, SYSTEM_TIMEOUT_S)
        results[name] = result if result["status"] == "ok" else {"error": f"{result['status']}: {result['error']}"}
    summary = {"benchmark": "grpo-step", "device": device, "model": model, "steps": steps, "warmup_steps": WARMUP_STEPS}
    summary["results"] = results
    summary["long_tail"] = partial_rollouts
    print(table(summary) if max_staleness is None and not partial_rollouts else staleness_table(summary))
    return summary


def staleness_table(summary: dict) -> str:
    """`--max-staleness` runs as a fixed-width table: step time, the trainer's wait, tokens/s, policy lag."""
    lines = [
        f"grpo-step on {summary['device']}, rollout_server by max_staleness: median of {summary['steps']} steps",
        f"{'run':<22}{'step s':>9}{'wait s':>9}{'train s':>9}{'tokens/s':>10}{'lag mean':>10}{'lag max':>9}"
        f"{'carried':>9}",
    ]
    for name, row in summary["results"].items():
        if "error" in row:
            lines.append(f"{name:<22} failed: {row['error']}")
            continue
        lines.append(
            f"{name:<22}{row['step_s']:>9.3f}{row['generation_s']:>9.3f}{row['training_s']:>9.3f}"
            f"{row['tokens_per_s']:>10.1f}{row['lag_mean']:>10.2f}{row['lag_max']:>9.0f}"
            f"{row.get('carried_over_mean', '-'):>9}"
        )
    return "\n".join(lines)


def table(summary: dict) -> str:
    """The summary as a fixed-width table, with each system's step time against rollout colocated's."""
    rows = summary["results"]
    base = rows.get("rollout_colocate", {}).get("step_s")
    lines = [
        f"grpo-step on {summary['device']}: median of {summary['steps']} steps after {summary['warmup_steps']} warm-up",
        f"{'system':<24}{'step s':>9}{'generation':>12}{'weight sync':>13}{'training':>10}{'peak GiB':>10}"
        f"{'vs colocate':>13}",
    ]
    for system, row in rows.items():
        if "error" in row:
            lines.append(f"{system:<24} failed: {row['error']}")
            continue
        ratio = f"{row['step_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{system:<24}{row['step_s']:>9.3f}{row['generation_s']:>12.3f}{row['weight_sync_s']:>13.3f}"
            f"{row['training_s']:>10.3f}{row['peak_memory_gib']:>10.2f}{ratio:>13}"
        )
    return "\n".join(lines)

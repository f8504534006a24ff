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

import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

SYSTEMS = ("rollout_colocate", "rollout_server", "trl_generate", "trl_generate_batch")
# Also measurable (not run by default): rollout_colocate without TRL's importance-sampling correction, whose extra
# no-grad forward over every completion (old_per_token_logps, which TRL's vLLM path always computes) is most of
# what a colocated step's training part costs beyond TRL's plain `generate` path.
EXTRA_SYSTEMS = ("rollout_colocate_no_is",)
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


def _config(output_dir: str, steps: int, device: str, **overrides: Any) -> Any:
    """The main job's GRPOConfig, quiet."""
    from rollout.presets.toy_grpo import toy_grpo_config

    return toy_grpo_config(output_dir, steps, use_cpu=device == "cpu", disable_tqdm=True, **overrides)


class _StepClock:
    """Seconds per training step, and the generation and weight-sync seconds inside each."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._started = 0.0

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock._started, clock._current = time.perf_counter(), {"generation": 0.0, "weight_sync": 0.0}

            def on_step_end(self, args, state, control, **kwargs):
                _device_sync()
                clock._current["step"] = time.perf_counter() - clock._started
                clock.steps.append(clock._current)

        return StepTimes()

    def timed(self, name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                _device_sync()
                self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - started

        return timed


def _device_sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _model(shape: str, device: str) -> Any:
    """The policy: the main job's tiny model, or the Qwen3-0.6B architecture (random weights; the tiny tokenizer
    still writes the prompts, and completion ids past its vocabulary decode to nothing)."""
    import torch
    from transformers import Qwen3Config

    from rollout.benchmarks.harness.workloads import QWEN3_0_6B, build_model
    from rollout.presets.models import tiny_model

    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; one of {list(MODEL_SHAPES)}")
    torch.manual_seed(0)
    if shape == "tiny":
        return tiny_model(0).to(device)
    return build_model(Qwen3Config(**QWEN3_0_6B), device, torch.float32)  # fp32 master weights, bf16 autocast


def measure_system(
    system: str,
    device: str,
    steps: int = STEPS,
    warmup: int = WARMUP_STEPS,
    max_staleness: int = 0,
    model: str = "tiny",
    partial: bool = False,
    long_tail: bool = False,
) -> dict:
    """`run_one` under the name `isolated.py` calls (in a process of its own)."""
    return run_one(system, device, steps, warmup, max_staleness, model, partial, long_tail)


def run_one(
    system: str,
    device: str,
    steps: int = STEPS,
    warmup: int = WARMUP_STEPS,
    max_staleness: int = 0,
    model_shape: str = "tiny",
    partial: bool = False,
    long_tail: bool = False,
) -> dict:
    """Train `warmup + steps` GRPO steps with `system` in this process; the timed steps' medians and peak memory
    (`max_staleness`: rollout_server's bound; the timed steps' tokens per second and policy lag are added;
    rollout_colocate on CUDA: the memory each `sleep()` hands back to the training step; `partial`:
    rollout_server with partial rollouts; `long_tail`: the long-tail lengths of `grpo_long_tail`)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import tempfile

    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from rollout.config import ContinuousBatchingConfig
    from rollout.presets.models import tiny_tokenizer
    from rollout.presets.toy_grpo import letter_reward, toy_prompts

    if system == "rollout_server" and model_shape != "tiny":
        raise ValueError("rollout_server runs its worker on the tiny preset only; use --model tiny for it")
    model = _model(model_shape, device)
    shape = MODEL_SHAPES[model_shape]
    if long_tail:
        from rollout.benchmarks.grpo.grpo_long_tail import CAP_TOKENS

        shape = {**shape, "max_completion_length": CAP_TOKENS, "per_device_train_batch_size": 32}
    common = dict(reward_funcs=letter_reward, train_dataset=Dataset.from_dict({"prompt": toy_prompts(256, 0)}))
    common["processing_class"] = tiny_tokenizer()
    output = tempfile.mkdtemp(prefix="grpo_step_")
    total = warmup + steps
    worker = None
    if system.startswith("rollout"):
        from trainer_bridge.trl import RolloutGRPOTrainer

        if system.startswith("rollout_colocate"):
            rollout = dict(rollout_mode="colocate", sleep_between_rounds=True)
            if system == "rollout_colocate_no_is":
                shape = {**shape, "vllm_importance_sampling_correction": False}
            rollout["rollout_engine_config"] = ContinuousBatchingConfig(num_blocks=COLOCATED_KV_BLOCKS[model_shape])
        else:
            worker, address = _start_worker(device)
            rollout = dict(rollout_workers=address, max_staleness=max_staleness, partial_rollouts=partial)
        trainer = RolloutGRPOTrainer(model=model, args=_config(output, total, device, **shape), **common, **rollout)
    elif system == "trl_generate":
        trainer = GRPOTrainer(model=model, args=_config(output, total, device, **shape), **common)
    elif system == "trl_generate_batch":
        config = _config(output, total, device, use_transformers_continuous_batching=True, **shape)
        trainer = GRPOTrainer(model=model, args=config, **common)
    else:
        raise ValueError(f"unknown system {system!r}; one of {list(SYSTEMS + EXTRA_SYSTEMS)}")
    if long_tail:
        from rollout.benchmarks.grpo.grpo_long_tail import force_lengths

        force_lengths(trainer.rollout_client)
    clock = _StepClock()
    trainer.add_callback(clock.callback())
    trainer._generate_single_turn = clock.timed("generation", trainer._generate_single_turn)
    if system.startswith("rollout"):
        trainer.rollout.sync_weights = clock.timed("weight_sync", trainer.rollout.sync_weights)
    if partial:  # the round's wait (and its push) happens before TRL's generation call, in take_round
        trainer.rollout.take_round = clock.timed("generation", trainer.rollout.take_round)
    sleeps: list[int] = []  # bytes each colocated sleep() handed back to the allocator's users (CUDA)
    if system.startswith("rollout_colocate") and device == "cuda":
        engine = trainer.rollout.engine
        engine.sleep = _measured_sleep(engine.sleep, sleeps)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
        peak = _peak_memory_gib(device, worker)
    finally:
        if getattr(trainer, "rollout_client", None) is not None:
            trainer.rollout_client.close()
        if worker is not None:
            worker.terminate()
            worker.wait(30)
    timed = clock.steps[warmup:]
    medians = {name: statistics.median(step[name] for step in timed) for name in ("step", "generation", "weight_sync")}
    result = {
        "step_s": round(medians["step"], 4),
        "generation_s": round(medians["generation"] - medians["weight_sync"], 4),
        "weight_sync_s": round(medians["weight_sync"], 4),
        "training_s": round(medians["step"] - medians["generation"], 4),
        "peak_memory_gib": round(peak, 3),
        "steps": len(timed),
    }
    logs = [entry for entry in trainer.state.log_history if "loss" in entry][warmup:]
    rows = trainer.args.per_device_train_batch_size
    tokens = sum(entry["completions/mean_length"] * rows for entry in logs)
    result["tokens_per_s"] = round(tokens / sum(step["step"] for step in timed), 1)
    if sleeps:
        result["sleep_frees_gib"] = round(statistics.median(sleeps) / 2**30, 3)
    if system.startswith("rollout_colocate"):  # graphs captured again because the cache or the parameters moved
        engine = trainer.rollout.engine
        result["graph_capture_s_per_round"] = round(engine.graph_capture_s / max(engine.num_rounds, 1), 4)
        result["graph_releases"] = engine.graph_releases
    if system == "rollout_server":
        result["max_staleness"] = max_staleness
        result["lag_mean"] = round(statistics.mean(entry["rollout/policy_lag_mean"] for entry in logs), 3)
        result["lag_max"] = max(entry["rollout/policy_lag_max"] for entry in logs)
        if partial:
            result["carried_over_mean"] = statistics.mean(entry["rollout/partial_carried_over"] for entry in logs)
    return result


def _measured_sleep(sleep: Any, freed: list[int]) -> Any:
    """`ColocatedEngine.sleep`, recording the CUDA memory it frees (allocated bytes before minus after)."""
    import torch

    def measured() -> None:
        before = torch.cuda.memory_allocated()
        sleep()
        freed.append(before - torch.cuda.memory_allocated())

    return measured


def _start_worker(device: str) -> tuple[subprocess.Popen, str]:
    """A rollout-worker on the tiny preset on `device`, answering; (process, address)."""
    from rollout.benchmarks.harness.worker_probe import free_port, wait_answering

    address = f"tcp://127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "rollout.service.launch.cli",
        "--model",
        "tiny",
        "--device",
        device,
        "--bind",
        address,
    ]
    command += ["--num-blocks", str(KV_BLOCKS), "--log-level", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if device == "cpu" else None  # the trainer needs the other core
    worker = subprocess.Popen(command, env=env)
    wait_answering(address, 120, lambda: None if worker.poll() is None else f"exit code {worker.returncode}")
    return worker, address


def _peak_memory_gib(device: str, worker: subprocess.Popen | None) -> float:
    """The trainer's peak (CUDA allocated bytes, or process RSS on CPU), plus the worker's peak RSS on CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if worker is not None:
        try:
            with open(f"/proc/{worker.pid}/status") as status:
                peak_kib += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return peak_kib / 2**20


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

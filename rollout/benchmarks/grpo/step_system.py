"""One system's GRPO steps for `rollout-bench grpo-step`, in a process of its own (`measure_system`, which
`rollout.benchmarks.harness.isolated` runs): TRL's GRPOTrainer (or RolloutGRPOTrainer) on the main job's task, its
steps timed and split into generation, weight sync and training, the policy lag and peak memory measured; for
`rollout_server` it starts the worker too."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from typing import Any

from rollout.benchmarks.grpo.grpo_step import (
    COLOCATED_KV_BLOCKS,
    EXTRA_SYSTEMS,
    KV_BLOCKS,
    MODEL_SHAPES,
    STEPS,
    SYSTEMS,
    WARMUP_STEPS,
)


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
    rollout_server with partial rollouts; `long_tail`: the long-tail lengths of `grpo_long_tail`). The trainer's
    output directory is a temporary one, removed when this returns or raises."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="grpo_step_") as output:
        return _run_in(output, system, device, steps, warmup, max_staleness, model_shape, partial, long_tail)


def _run_in(
    output: str,
    system: str,
    device: str,
    steps: int,
    warmup: int,
    max_staleness: int,
    model_shape: str,
    partial: bool,
    long_tail: bool,
) -> dict:
    """`run_one`, with the trainer's output directory `output`."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
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
    total = warmup + steps
    worker = None
    if system.startswith("rollout"):
        from trainer_bridge.trl import RolloutGRPOTrainer

        if system.startswith("rollout_colocate"):
            rollout = dict(rollout_mode="colocate", sleep_between_rounds=True)
            if system == "rollout_colocate_no_is":
                shape = {**shape, "vllm_importance_sampling_correction": False}
            rollout["batch_invariant"] = system == "rollout_colocate_invariant"
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
            from rollout.benchmarks.harness.worker_probe import stop_worker

            stop_worker(worker, 30)
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
    """`ColocatedEngine.sleep`, recording the CUDA memory a round's sleep frees (allocated bytes before minus after).
    Its arguments pass through: the end of `train()` calls `sleep(graphs=True)` (not recorded: it frees the graphs
    too, after the last round's sleep freed the cache)."""
    import torch

    def measured(*args: Any, **kwargs: Any) -> None:
        before = torch.cuda.memory_allocated()
        sleep(*args, **kwargs)
        if not args and not kwargs:
            freed.append(before - torch.cuda.memory_allocated())

    return measured


def _start_worker(device: str) -> tuple[subprocess.Popen, str]:
    """A rollout-worker on the tiny preset on `device`, answering; (process, address)."""
    from rollout.benchmarks.harness.worker_probe import free_port, wait_answering, worker_command

    address = f"tcp://127.0.0.1:{free_port()}"
    command = worker_command(address, ["--num-blocks", str(KV_BLOCKS)], device)
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

"""`rollout-bench weights --lora-rank R`: adapter-only pushes against merged pushes of the same PEFT model, into a
`rollout-worker` subprocess serving the `sized:<MB>` preset over loopback.

The trainer side is a PEFT LoRA model (rank R on every Linear layer) over the worker's own start weights. The first
adapter push also carries the frozen base (the worker does not hold this trainer's base yet) and is reported apart;
then `repeats` adapter-only pushes, each after the adapter moved (a training step), then `repeats` merged pushes
(`adapters="merged"`: base + LoRA delta under the base names) after one untimed merged push (a run that pushes merged
weights every step has its staging area warm). Seconds are from `push_weights` called to every
worker serving the new weights (`PushResult.total_s`); bytes are what one push sends per worker.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import torch

from rollout.benchmarks.harness.worker_probe import free_port, stop_worker, wait_answering
from rollout.presets.models import MODEL_DTYPES, sized_model


def _summary(runs: list) -> dict:
    return {
        "bytes": runs[-1].num_bytes,
        "total_s": round(statistics.median(r.total_s for r in runs), 4),
        "transfer_s": round(statistics.median(r.transfer_s for r in runs), 4),
        "pause_ms": round(statistics.median(r.workers[0]["pause_ms"] for r in runs), 2),
    }


def run(megabytes: float, rank: int, repeats: int, device: str = "cpu", dtype: str = "float32") -> dict:
    """Measure and print adapter-only against merged pushes; return the JSON-able summary (medians).

    Args:
        megabytes: size of the base model's weights in `dtype`.
        rank: the LoRA rank (on every Linear layer but the output head).
        repeats: pushes per mode.
        device: where the worker serves and the trainer-side model lives ("cpu", "cuda" or "cuda:N").
        dtype: the base model's dtype (the adapter stays fp32, as peft keeps it).
    """
    from peft import LoraConfig, get_peft_model

    from trainer_bridge import RolloutClient, push_weights

    place = torch.device(device)
    if place.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device is available")
    base = sized_model(megabytes, seed=0, dtype=MODEL_DTYPES[dtype], device=place)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    address = f"tcp://127.0.0.1:{free_port()}"
    where = ["--gpu", str(place.index or 0)] if place.type == "cuda" else ["--device", device]
    flags = ["--bind", address, *where, "--dtype", dtype, "--model", f"sized:{megabytes:g}", "--num-blocks", "64"]
    flags += ["--max-lora-rank", str(rank), "--max-loras", "1", "--log-level", "WARNING"]
    worker = subprocess.Popen([sys.executable, "-m", "rollout.service.launch.cli", *flags])
    try:
        wait_answering(address, 180, lambda: None if worker.poll() is None else f"status {worker.returncode}")
        with RolloutClient(address, timeout=600) as client:
            first = push_weights(client, model, timeout=300)
            adapter_runs, merged_runs = [], []
            for _ in range(repeats):
                with torch.no_grad():  # a training step: the adapter moves
                    for name, parameter in model.named_parameters():
                        if "lora_B" in name:
                            parameter.add_(torch.randn_like(parameter) * 1e-3)
                adapter_runs.append(push_weights(client, model, timeout=300))
            for _ in range(repeats + 1):  # the first, untimed, warms the worker's merged-sized staging area up
                merged_runs.append(push_weights(client, model, adapters="merged", timeout=300))
            merged_runs = merged_runs[1:]
    finally:
        stop_worker(worker)
    results = {
        "first (base + adapter)": _summary([first]),
        "adapter-only": _summary(adapter_runs),
        "merged": _summary(merged_runs),
    }
    speedup = results["merged"]["total_s"] / max(results["adapter-only"]["total_s"], 1e-9)
    print(f"weights --lora-rank {rank}: sized:{megabytes:g} ({dtype}) on {device}, median of {repeats} pushes per mode")
    print(f"{'push':<24}{'MB':>10}{'push s':>10}{'transfer s':>12}{'pause ms':>10}")
    for name, row in results.items():
        print(
            f"{name:<24}{row['bytes'] / 1e6:>10.2f}{row['total_s']:>10.4f}{row['transfer_s']:>12.4f}"
            f"{row['pause_ms']:>10.1f}"
        )
    print(f"adapter-only push is {speedup:.1f}x faster than a merged push (goal: 10x)")
    return {
        "benchmark": "weights-lora",
        "device": device,
        "dtype": dtype,
        "rank": rank,
        "repeats": repeats,
        "results": results,
        "speedup": round(speedup, 2),
    }

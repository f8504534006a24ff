"""`rollout-bench weights`: push a state dict of a given size to a `rollout-worker` subprocess over loopback, with
each transport, and report GB/s of transfer and the engine's commit pause (the "weights" workload of
docs/concepts/architecture.md, Benchmark workloads).

The worker serves the `sized:<MB>` preset; the trainer side is the same architecture with other weights, so every
push really changes the model. GB/s counts update bytes over the time from `weights_begin` to the last bucket
acknowledged; the pause is how long the engine stood still at commit, of which `copy` is the in-place copy itself.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import torch

from rollout.benchmarks.harness.worker_probe import free_port, stop_worker, wait_answering
from rollout.presets.models import MODEL_DTYPES, sized_model
from rollout.protocol.transports import WEIGHT_TRANSPORTS


def run(
    megabytes: float,
    transports: list[str] | None,
    repeats: int,
    bucket_mb: float,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Push `repeats` times per transport; return the JSON-able summary of medians (also printed as a table).

    Args:
        megabytes: size of the state dict in `dtype`.
        transports: transports to measure, in order (default: all).
        repeats: pushes per transport (the median is reported).
        bucket_mb: bucket size in MB.
        device: where the worker serves and the trainer-side model lives ("cpu", "cuda" or "cuda:N").
        dtype: parameter dtype on both sides, a `rollout-worker --dtype` name other than "auto".
    """
    from trainer_bridge import RolloutClient, push_weights

    transports = list(transports or WEIGHT_TRANSPORTS)
    place = torch.device(device)
    if place.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device is available")
    address = f"tcp://127.0.0.1:{free_port()}"
    where = ["--gpu", str(place.index or 0)] if place.type == "cuda" else ["--device", device]
    flags = ["--bind", address, *where, "--dtype", dtype, "--model", f"sized:{megabytes:g}", "--num-blocks", "64"]
    # Two sets of weights, alternated, so every push really changes the model (built first: a failure here must not
    # leave a worker behind).
    models = [sized_model(megabytes, seed=seed, dtype=MODEL_DTYPES[dtype], device=place) for seed in (1, 2)]
    worker = subprocess.Popen([sys.executable, "-m", "rollout.service.launch.cli", *flags, "--log-level", "WARNING"])
    results: dict[str, dict] = {}
    try:
        wait_answering(address, 120, lambda: None if worker.poll() is None else f"status {worker.returncode}")
        with RolloutClient(address, timeout=600) as client:
            pushes = 0
            for transport in transports:
                runs = []
                for _ in range(repeats):
                    model = models[pushes % 2]
                    pushes += 1
                    runs.append(
                        push_weights(client, model, transport=transport, bucket_bytes=int(bucket_mb * 1e6), timeout=300)
                    )
                worker_side = [r.workers[0] for r in runs]
                results[transport] = {
                    "gb_per_s": round(statistics.median(r.gb_per_s for r in runs), 3),
                    "transfer_s": round(statistics.median(r.transfer_s for r in runs), 4),
                    "total_s": round(statistics.median(r.total_s for r in runs), 4),
                    "pause_ms": round(statistics.median(w["pause_ms"] for w in worker_side), 2),
                    "copy_ms": round(statistics.median(w["copy_ms"] for w in worker_side), 2),
                    "pause_beyond_copy_ms": round(
                        statistics.median(w["pause_ms"] - w["copy_ms"] for w in worker_side), 2
                    ),
                }
            num_bytes = runs[-1].num_bytes
    finally:
        stop_worker(worker)
    print(
        f"weights: {num_bytes / 1e9:.3f} GB {dtype} state dict over loopback into a worker on {device}, "
        f"median of {repeats} pushes per transport"
    )
    print(f"{'transport':<20}{'GB/s':>8}{'transfer s':>12}{'pause ms':>10}{'copy ms':>10}{'pause-copy ms':>15}")
    for name, row in results.items():
        print(
            f"{name:<20}{row['gb_per_s']:>8.2f}{row['transfer_s']:>12.3f}{row['pause_ms']:>10.1f}"
            f"{row['copy_ms']:>10.1f}{row['pause_beyond_copy_ms']:>15.2f}"
        )
    return {
        "benchmark": "weights",
        "device": device,
        "dtype": dtype,
        "bytes": num_bytes,
        "repeats": repeats,
        "results": results,
    }

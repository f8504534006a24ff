"""`rollout-bench service`: the cost of the socket. The cpu-small workload (on the built-in "tiny" preset, which has
its shape) run in-process with `generate_batch`, then through one `rollout-worker` subprocess: over ZeroMQ with
`RolloutClient` (whole group results with `generate_many`, and streamed deltas, one `stream` per group, consumed
concurrently) and, with `--path http` or `all`, over its OpenAI-compatible HTTP API (service_http.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from rollout.benchmarks.harness.worker_probe import free_port, stop_worker, wait_answering
from rollout.benchmarks.harness.workloads import WORKLOADS, make_workload
from rollout.benchmarks.service import service_http
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.generate import generate_batch
from rollout.presets.models import tiny_model


def run(seed: int = 0, path: str = "zmq") -> dict:
    """Run the variants one after another and return the JSON-able summary (also printed as a table).

    Args:
        seed: the workload's prompt seed.
        path: "zmq" (ZeroMQ results and streams), "http" (ZeroMQ results as the reference, then the HTTP API's
            results and streams), or "all".
    """
    from trainer_bridge import PromptGroup, RolloutClient

    workload = WORKLOADS["cpu-small"]
    _, prompts, max_new = make_workload(workload, seed)
    engine = workload.cache_config()
    useful = sum(max_new)
    timings: dict[str, float] = {}

    sampling = [SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=m) for m in max_new]
    start = time.perf_counter()
    local = generate_batch(
        tiny_model(),
        prompts,
        continuous_batching_config=ContinuousBatchingConfig(**engine),
        progress_bar=False,
        sampling=sampling,
    )
    timings["in_process"] = time.perf_counter() - start

    address = f"tcp://127.0.0.1:{free_port()}"
    http_port = free_port()
    flags = [
        "--http",
        f"127.0.0.1:{http_port}",
        "--bind",
        address,
        "--device",
        "cpu",
        "--log-level",
        "WARNING",
        "--block-size",
        str(engine["block_size"]),
        "--num-blocks",
        str(engine["num_blocks"]),
        "--max-batch-tokens",
        str(engine["max_batch_tokens"]),
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
    ]
    worker = subprocess.Popen([sys.executable, "-m", "rollout.service.launch.cli", *flags])
    try:
        wait_answering(address, 120, lambda: None if worker.poll() is None else f"status {worker.returncode}")
        with RolloutClient(address, timeout=600) as client:
            greedy = {"do_sample": False, "stop_token_ids": []}
            groups = [
                PromptGroup(p, 1, {**greedy, "max_new_tokens": m}, f"b{i}")
                for i, (p, m) in enumerate(zip(prompts, max_new))
            ]
            start = time.perf_counter()
            results = {r.group_id: r for r in client.generate_many(groups)}
            timings["socket_results"] = time.perf_counter() - start
            same = sum(
                results[f"b{i}"].completions[0].token_ids == local[f"req_{i}"].generated_tokens
                for i in range(len(prompts))
            )

            if path in ("http", "all"):
                http_timings, http_tokens = service_http.measure(f"http://127.0.0.1:{http_port}/v1", prompts, max_new)
                timings.update(http_timings)
                same_http = sum(http_tokens[i] == local[f"req_{i}"].generated_tokens for i in range(len(prompts)))
            if path != "http":
                timings["socket_stream"] = _stream_all(client, groups, useful)
    finally:
        stop_worker(worker)
    summary = {
        "benchmark": "service",
        "workload": "cpu-small",
        "path": path,
        "generated_tokens": useful,
        "identical_tokens_socket_vs_in_process": f"{same}/{len(prompts)}",
        "results": {
            name: {"seconds": round(t, 3), "tokens_per_s": round(useful / t, 1)} for name, t in timings.items()
        },
    }
    if path in ("http", "all"):
        summary["identical_tokens_http_vs_in_process"] = f"{same_http}/{len(prompts)}"
        summary["http_vs_zmq_results"] = round(timings["socket_results"] / timings["http_results"], 3)
    print(f"service overhead, cpu-small workload ({useful} generated tokens), one run each")
    print(f"{'variant':<20}{'seconds':>10}{'tokens/s':>12}{'vs in-process':>15}")
    for name, t in timings.items():
        print(f"{name:<20}{t:>10.2f}{useful / t:>12.1f}{timings['in_process'] / t:>14.2f}x")
    return summary


def _stream_all(client: object, groups: list, useful: int) -> float:
    """Seconds to stream every group at once (a thread per group); checks the deltas add up to `useful` tokens."""
    from trainer_bridge import GroupResult, PromptGroup

    streamed: list[int] = []

    def consume(group: PromptGroup) -> None:
        for event in client.stream(PromptGroup(group.prompt_ids, 1, group.sampling)):
            if not isinstance(event, GroupResult):
                streamed.append(len(event.token_ids))

    threads = [threading.Thread(target=consume, args=(g,)) for g in groups]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    assert sum(streamed) == useful, "streamed deltas do not add up to the generated tokens"
    return seconds

"""`rollout-bench fleet`: a `RolloutFleet` on Ray (needs `pip install 'rollout[ray]'`): how long from `launch` to the
first group, how long a killed worker takes to serve again (Ray's restart, the model load, the weight copy from a
peer), and the torch.distributed (gloo) fan-out of a push to every worker vs to one.

Starts a local Ray instance unless RAY_ADDRESS names a cluster. Steps: launch `--workers` workers of `--model`; one
group (n=8, 32 tokens); a frames push of version 1 (so a restarted worker has weights to copy); `--repeats` gloo pushes
to all workers; SIGKILL of worker 0's actor, timed until its new process serves in the client with version 1; the
fleet shrunk to one worker and `--repeats` gloo pushes to it. GB/s counts update bytes over the time from
`weights_begin` to the last bucket acknowledged (median of the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout.presets.models import sized_model, tiny_model


def _trainer_model(model: str, seed: int, device: str) -> torch.nn.Module:
    if model == "tiny":
        return tiny_model(seed).to(device)
    if model.startswith("sized:"):
        return sized_model(float(model.removeprefix("sized:")), seed=seed).to(device)
    raise SystemExit(f"--model {model}: tiny or sized:<MB> (the trainer side builds the same model)")


def _fan_out(client, model: torch.nn.Module, version: int, repeats: int, backend: str) -> tuple[dict, int]:
    from trainer_bridge import push_weights

    rates = []
    for _ in range(repeats):
        version += 1
        result = push_weights(client, model, version=version, transport="torch.distributed", dist_backend=backend)
        rates.append(result.num_bytes / result.transfer_s / 1e9)
    return {"gb_per_s": statistics.median(rates), "workers": len(client.live_workers())}, version


def run(args: argparse.Namespace) -> dict:
    """Measure (see the module docstring); return the JSON-able summary (also printed as a table)."""
    import ray

    from rollout.ray import RolloutFleet
    from trainer_bridge import PromptGroup, push_weights

    if args.workers < 2 or args.repeats < 1:
        raise SystemExit("--workers must be >= 2 (one is killed, and fan-out compares all with one), --repeats >= 1")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    gpu = args.device == "cuda"
    worker_args = ["--num-blocks", "256", "--log-level", "WARNING"] + ([] if gpu else ["--device", "cpu"])
    trainer_device = "cuda" if gpu else "cpu"
    models = [_trainer_model(args.model, seed, trainer_device) for seed in (1, 2)]
    backend = "nccl" if gpu else "gloo"
    started = time.monotonic()
    fleet = RolloutFleet.launch(
        args.workers, model=args.model, resources_per_worker={"GPU": 1} if gpu else {"CPU": 1}, worker_args=worker_args
    )
    summary: dict = {"model": args.model, "workers": args.workers, "device": args.device}
    try:
        summary["launch_s"] = time.monotonic() - started
        client = fleet.client(timeout=600, heartbeat_s=0.2, dead_after_s=3.0)
        group = PromptGroup(list(range(4, 36)), n=8, sampling={"max_new_tokens": 32, "stop_token_ids": []})
        client.generate(group)
        summary["launch_to_first_group_s"] = time.monotonic() - started
        push_weights(client, models[0], version=1)
        summary["fan_out_all"], version = _fan_out(client, models[1], 1, args.repeats, backend)

        killed = fleet.addresses[0]
        killed_at = time.monotonic()
        ray.kill(fleet.workers[0], no_restart=False)
        deadline = killed_at + 600
        while True:
            address = fleet.addresses[0]
            if address != killed and address in client.worker_addresses:
                stats = {entry["address"]: entry for entry in client.stats()}
                if stats.get(address, {}).get("policy_version") == version:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the killed worker did not serve again within 600 s")
            time.sleep(0.05)
        summary["restart_to_serving_s"] = time.monotonic() - killed_at
        copies = [copy for copy in fleet._membership.copies if copy["to"] == fleet.addresses[0]]
        summary["peer_copy_s"] = copies[-1]["s"] if copies else None
        client.generate(group)  # it serves

        fleet.scale(1)
        summary["fan_out_one"], version = _fan_out(client, models[0], version, args.repeats, backend)
    finally:
        fleet.shutdown()
    _print(summary)
    return summary


def _print(summary: dict) -> None:
    copy = summary["peer_copy_s"]
    rows = [
        ("launch (all workers serving)", f"{summary['launch_s']:.1f} s"),
        ("launch to first group", f"{summary['launch_to_first_group_s']:.1f} s"),
        ("killed worker serving again", f"{summary['restart_to_serving_s']:.1f} s"),
        ("  of which the peer weight copy", "none" if copy is None else f"{copy:.2f} s"),
        (f"fan-out to {summary['fan_out_all']['workers']} workers", f"{summary['fan_out_all']['gb_per_s']:.2f} GB/s"),
        (f"fan-out to {summary['fan_out_one']['workers']} worker", f"{summary['fan_out_one']['gb_per_s']:.2f} GB/s"),
    ]
    print(f"fleet of {summary['workers']} workers, model {summary['model']}, {summary['device']}")
    for name, value in rows:
        print(f"  {name:<34} {value}")

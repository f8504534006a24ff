"""The main job: GRPO with TRL's GRPOTrainer generating through a rollout worker, on a fresh machine in under a minute.

    python examples/grpo_toy.py            # no arguments; about 45 s on a 2-core machine, worker start included
    python examples/grpo_toy.py --colocate # the same task with no worker: generation in the trainer's process
    python examples/grpo_toy.py --max-staleness 2  # asynchronous: the next 2 rounds generate while it trains
    python examples/grpo_toy.py --max-staleness 1 --partial-rollouts  # rounds train the first complete groups

It starts a `rollout-worker` subprocess serving the built-in tiny model (a random Qwen3-style model built in code,
nothing downloaded), builds the matching tokenizer in code (one token per character when it encodes), and trains the same tiny model with
`trainer_bridge.trl.RolloutGRPOTrainer`: completions come from the worker (with the logprob and policy version of
every token), and the trainer pushes its weights to the worker before every generation round. With `--colocate`
there is no worker: each generation round runs the engine in the trainer's process on the model being trained
(`rollout_mode="colocate"`), nothing is pushed, and the KV cache is freed between rounds (`sleep_between_rounds`).
With `--max-staleness k` the worker generates the next k rounds while the trainer trains (`max_staleness=k`):
samples may come from weights up to k steps old, and the plot's policy lag shows how old they were. With
`--partial-rollouts` (and `--max-staleness 1` or more) a round trains the first complete groups and the others
carry into the next round (`partial_rollouts=True`).

The task: answer with lowercase letters only. The reward of a completion is the fraction of its tokens that are
lowercase letters (26 of the model's 1024 token ids), so an untrained model scores about 0.03 and the reward rises
as the policy learns. The script prints the reward of every step (with the trainer's progress bar), writes a PNG plot
of reward and policy lag per step, reports the mean reward of the first and last 5 steps, and stops the worker at
the end, even on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers.trainer_callback import ProgressCallback  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.cli.extras import MissingExtra, require_extra  # noqa: E402
from rollout.presets import letter_reward, tiny_model, tiny_tokenizer, toy_grpo_config, toy_prompts  # noqa: E402
from trainer_bridge import RolloutClient, RolloutError  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402

TOKENIZER = tiny_tokenizer()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(address: str, model: str = "tiny", flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """A rollout-worker on a preset model (the tiny one by default), with extra `flags`; returns once it answers."""
    command = [sys.executable, "-m", "rollout.service.launch.cli", "--model", model, "--device", "cpu"]
    command += ["--bind", address, *flags]
    # One compute thread for the tiny worker: on a 2-core machine the trainer needs the other core.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("ROLLOUT_WORKER_THREADS", "1")}
    # Its own session: a terminal's Ctrl-C reaches this script alone, which stops the worker on its way out.
    flags = [*command, "--num-blocks", "512", "--log-level", "WARNING"]
    worker = subprocess.Popen(flags, env=env, start_new_session=True)
    try:
        with RolloutClient(address, timeout=120) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    client.stats(timeout=2)
                    return worker
                except Exception:  # noqa: BLE001 - not up yet
                    if worker.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the rollout-worker did not start") from None
    except BaseException:  # Ctrl-C while it starts, too: the worker does not outlive the example
        stop_worker(worker)
        raise


def stop_worker(worker: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not stopped within 30 s."""
    worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


class RewardLog(ProgressCallback):
    """The trainer's progress bar, printing reward and policy lag per step (instead of every logged metric); keeps
    them for the plot."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            row = {"step": state.global_step, "reward": logs["reward"], "lag": logs.get("rollout/policy_lag_mean", 0.0)}
            self.rows.append(row)
            line = f"step {row['step']:3d}  reward {row['reward']:.3f}  policy lag {row['lag']:.2f}"
            (self.training_bar.write if self.training_bar is not None else print)(line)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, [r["reward"] for r in rows], marker="o", markersize=3)
    top.set_ylabel("mean reward")
    top.set_title(f"GRPO {title} (tiny model, letters-only task)")
    bottom.plot(steps, [r["lag"] for r in rows], marker="o", markersize=3, color="tab:orange")
    bottom.set_ylabel("policy lag (steps)")
    bottom.set_xlabel("training step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps",
        type=int,
        default=100,
        help="training steps (default: 100); the exit status is 1 when the last 5 steps' mean reward is not above "
        "the first 5's (with fewer than 10 steps, 0)",
    )
    parser.add_argument("--output-dir", default="grpo_toy_output", help="where the plot and trainer files go")
    parser.add_argument("--worker", default=None, help="use a running rollout-worker at this address instead")
    parser.add_argument(
        "--colocate", action="store_true", help="generate in the trainer's process on its own model (no worker)"
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="generate the next k rounds while training; samples up to k steps old (default: 0, synchronous)",
    )
    parser.add_argument(
        "--partial-rollouts",
        action="store_true",
        help="rounds train the first complete groups, stragglers join the next round (needs --max-staleness 1+)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="train and sample in bf16 (the model built in bf16, as the worker builds it)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="rollout's log-probs equal the trainer's bit for bit (TRL's importance ratio exactly 1); slower",
    )
    args = parser.parse_args(argv)
    if args.colocate and args.worker:
        parser.error("--colocate runs no worker: it cannot be combined with --worker")
    if args.max_staleness < 0 or (args.max_staleness and args.colocate):
        parser.error("--max-staleness must be >= 0, and needs a worker (not --colocate)")
    if args.partial_rollouts and args.max_staleness < 1:
        parser.error("--partial-rollouts needs --max-staleness 1 or more (a straggler spans two rounds)")
    try:  # the plot is drawn after training: a missing matplotlib is found before the run, not after it
        require_extra("examples", "examples/grpo_toy.py (its reward plot)")
    except MissingExtra as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    random.seed(0)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)

    address = args.worker or f"tcp://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    flags = (*(("--dtype", "bfloat16") if args.bf16 else ()), *(("--batch-invariant",) if args.batch_invariant else ()))
    worker = None if args.worker or args.colocate else start_worker(address, flags=flags)
    # colocated: the engine in this process (its cache sized like the worker's, 512 blocks of 16 tokens, and freed
    # for every training step; its samples seeded, as torch and random are above, so that a run repeats); else the
    # worker's address
    engine_config = ContinuousBatchingConfig(num_blocks=512, seed=0, batch_invariant=args.batch_invariant)
    colocated = dict(rollout_engine_config=engine_config, sleep_between_rounds=True)
    rollout = dict(rollout_mode="colocate", **colocated) if args.colocate else dict(rollout_workers=address)
    if args.max_staleness:
        rollout["max_staleness"] = args.max_staleness
    if args.partial_rollouts:
        rollout["partial_rollouts"] = True
    if args.batch_invariant:
        rollout["batch_invariant"] = True
    trainer = None
    try:
        prompts = toy_prompts(256, seed=0)
        config = toy_grpo_config(str(output), args.steps)  # the same dtype on both sides: logprobs match (sampling/*)
        log = RewardLog()
        trainer = RolloutGRPOTrainer(
            model=tiny_model(0, dtype=dtype),
            reward_funcs=letter_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=TOKENIZER,
            **rollout,
        )
        trainer.remove_callback(ProgressCallback)  # RewardLog is the progress bar
        trainer.add_callback(log)
        trainer.train()
    finally:  # the trainer's client first: a worker stopping under it would be reported lost
        try:
            if trainer is not None:
                trainer.close()  # its client, or its colocated engine
        finally:  # (a second Ctrl-C during close still stops the worker)
            if worker is not None:
                stop_worker(worker)
    elapsed = time.perf_counter() - started
    rewards = [r["reward"] for r in log.rows]
    first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    title = "colocated" if args.colocate else "through a rollout worker"
    if args.max_staleness:
        title += f", max staleness {args.max_staleness}"
    if args.partial_rollouts:
        title += ", partial rollouts"
    plot(log.rows, output / "reward.png", title)
    if args.colocate:
        setup = "colocated, no worker"
    elif args.worker:
        setup = f"through the running worker at {args.worker}"
    else:
        setup = "worker start included"
    print(f"\nmean reward, first 5 steps: {first:.3f}; last 5 steps: {last:.3f} ({elapsed:.0f} s, {setup})")
    steps = [entry for entry in trainer.state.log_history if "sampling/sampling_logp_difference/max" in entry]
    if steps:  # TRL's own comparison of rollout's log-probs with its teacher-forced ones
        largest = max(entry["sampling/sampling_logp_difference/max"] for entry in steps)
        low = min(entry["sampling/importance_sampling_ratio/min"] for entry in steps)
        high = max(entry["sampling/importance_sampling_ratio/max"] for entry in steps)
        # With batch_invariant the trainer skips TRL's old-policy forward at lag 0 (the rollout's log-probs are its
        # values, bit for bit): then TRL compares the rollout's log-probs with themselves, and says nothing more.
        skipped = sum(entry.get("rollout/old_logps_forward_skipped", 0.0) for entry in steps)
        note = f" (old-policy forward skipped at {skipped:.0f} of {len(steps)} steps)" if skipped else ""
        print(
            f"TRL's largest |sampling - trainer| log-prob difference: {largest:.3g}; importance ratio "
            f"{low:.6g}..{high:.6g}{note}"
        )
    print(f"plot: {output / 'reward.png'}")
    if len(rewards) < 10:  # the first and last 5 steps overlap: no rise to judge, the run itself is the result
        return 0
    return 0 if last > first else 1  # the reward must rise over the run


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RolloutError as error:  # no worker at --worker, say: the message says what to check
        sys.exit(f"grpo_toy: {error}")
    except KeyboardInterrupt:  # Ctrl-C: the worker it started was stopped on the way out; no traceback
        print("grpo_toy: interrupted", file=sys.stderr)
        sys.exit(130)

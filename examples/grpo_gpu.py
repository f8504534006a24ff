"""GRPO on a real model with rollout workers on GPUs: the recipe of the GPU guide (docs/guides/gpus.md).

    rollout-worker --gpu 0 --model Qwen/Qwen3-0.6B --dtype bfloat16 --bind tcp://127.0.0.1:5555 &
    CUDA_VISIBLE_DEVICES=1 python examples/grpo_gpu.py --model Qwen/Qwen3-0.6B --workers tcp://127.0.0.1:5555

(`accelerate launch` works too: every rank generates its own rows; only the main process pushes weights.)
The task is small-number addition with an exact-match reward. `--model tiny` runs the same script on the built-in
tiny model on CPU (a smoke run: that model cannot learn arithmetic), against a worker started with
`rollout-worker --model tiny`.
"""

from __future__ import annotations

import argparse
import random
import re
import sys

import torch
from datasets import Dataset
from trl import GRPOConfig

from trainer_bridge.trl import RolloutGRPOTrainer


def addition_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 when the first number in the completion is the right sum, else 0.0."""
    rewards = []
    for text, expected in zip(completions, answer):
        found = re.search(r"-?\d+", text)
        rewards.append(1.0 if found and found.group() == expected else 0.0)
    return rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory or hub id (the worker's), or 'tiny'")
    parser.add_argument("--workers", nargs="+", required=True, help="rollout worker addresses")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    parser.add_argument("--output-dir", default="grpo_gpu_output", help="trainer output directory")
    args = parser.parse_args(argv)
    if args.model == "tiny":
        from rollout.presets import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model(0), tiny_tokenizer()
    else:
        from rollout.service.launch.loading import load_model, load_tokenizer

        try:  # a hub id on a machine without network is one line at once, not a minute of retries
            model = load_model(args.model, torch.bfloat16, torch.device("cpu"))  # the trainer places it
            tokenizer, _ = load_tokenizer(args.model, None)
        except (ValueError, OSError) as error:
            parser.error(str(error).splitlines()[0])
    rng = random.Random(0)
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(2048)]
    dataset = Dataset.from_dict(
        {"prompt": [f"{a} + {b} = " for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=16,
        learning_rate=1e-6 if args.model != "tiny" else 1e-3,
        beta=0.0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
    )
    trainer = RolloutGRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_workers=args.workers,
    )
    trainer.train()
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

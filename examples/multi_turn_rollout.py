"""Multi-turn rollouts with TRL's `rollout_func` through a rollout worker: the model answers, a toy environment
replies, the model answers again; only the model's tokens are trained on (`env_mask`).

    python examples/multi_turn_rollout.py [--steps 10]

`RolloutGRPOTrainer` syncs the weights before each call (as TRL does for vLLM); inside `rollout_func`,
`trainer.rollout.generate_rows(prompt_ids, **sampling)` samples one completion per row through the workers and
returns their token ids, logprobs and policy versions. Reuses the tiny-model task of `grpo_toy.py`.
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from datasets import Dataset  # noqa: E402
from grpo_toy import TOKENIZER, free_port, start_worker  # noqa: E402

from rollout.presets import letter_reward, tiny_model, toy_grpo_config  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402

TURN_TOKENS = 8
ENV_REPLY = TOKENIZER("\nok, go on: ", add_special_tokens=False)["input_ids"]


def two_turn_rollout(prompts: list[str], trainer: RolloutGRPOTrainer) -> dict:
    """Turn 1 from the model, a fixed environment reply, turn 2 from the model (on prompt + turn 1 + reply)."""
    prompt_ids = [TOKENIZER(p, add_special_tokens=False)["input_ids"] for p in prompts]
    first = trainer.rollout.generate_rows(prompt_ids, max_new_tokens=TURN_TOKENS)
    followups = [p + c + ENV_REPLY for p, c in zip(prompt_ids, first.completion_ids)]
    second = trainer.rollout.generate_rows(followups, max_new_tokens=TURN_TOKENS)
    completion_ids, logprobs, env_mask = [], [], []
    for turn1, lp1, turn2, lp2 in zip(first.completion_ids, first.logprobs, second.completion_ids, second.logprobs):
        completion_ids.append(turn1 + ENV_REPLY + turn2)
        logprobs.append(lp1 + [0.0] * len(ENV_REPLY) + lp2)  # environment tokens are masked out of the loss
        env_mask.append([1] * len(turn1) + [0] * len(ENV_REPLY) + [1] * len(turn2))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, "env_mask": env_mask}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    parser.add_argument("--output-dir", default="multi_turn_output", help="trainer output directory")
    args = parser.parse_args(argv)
    random.seed(0)
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(address)
    try:
        prompts = ["".join(random.choices(string.ascii_letters, k=8)) + ": " for _ in range(64)]
        config = toy_grpo_config(
            args.output_dir,
            args.steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=2 * TURN_TOKENS + len(ENV_REPLY),
        )
        trainer = RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=letter_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=TOKENIZER,
            rollout_func=two_turn_rollout,
            rollout_workers=address,
        )
        trainer.train()
        rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
        print(f"reward per step: {[round(r, 3) for r in rewards]}")
        trainer.close()
    finally:
        worker.terminate()
        worker.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An agent trained with TRL's own tool loop through a rollout worker: GRPOTrainer's `environment_factory=`.

    python examples/agent_trl.py             # about 20 s on a 2-core machine, worker start included
    python examples/agent_trl.py --colocate  # the same with no worker: generation in the trainer's process

Each rollout gets its own `Calculator` environment. TRL renders the environment's `multiply` method as a tool in the
chat template, samples a turn through rollout, runs the tool call it finds in the completion, appends the result as
a tool turn and samples the next turn, until a turn calls no tool. The environment scores the rollout
(`get_reward`): 1 when the right product came back from a well-formed call, else 0.

The policy is the built-in scripted tool caller (`rollout-worker --model tiny-agent`: one Qwen3 layer whose logits
call a tool or refuse, then answer once a tool result is in the conversation; small random weights under the
script; only its output head trains here). It cannot read the question, but it can learn which first turn pays:
it starts with a third each of a right call, a call that misnames an argument (`c` for `b`) and a refusal, so its
reward starts near 0.33, and GRPO raises it.
Every turn's tokens come back with their log-probs and policy versions; TRL masks the tool-result tokens out of the
loss itself. The script prints the reward of each step and the mean reward of the first and last 5 steps, and
stops the worker at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

from rollout.presets import scripted_agent, toy_grpo_config  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_toy import free_port, start_worker  # noqa: E402

CALLS = [{"name": "multiply", "arguments": {"a": 3, "b": 4}}, {"name": "multiply", "arguments": {"a": 3, "c": 4}}]


class Calculator:
    """One rollout's environment: the question's operands, and what the agent's tool calls returned."""

    def reset(self, a: int, b: int, **row: object) -> str:
        self.a, self.b, self.answers = a, b, []
        return f" What is {a} times {b}?"

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.answers.append(a * b)
        return a * b

    def get_reward(self) -> float:
        return float(self.a * self.b in self.answers)


class RewardLog(TrainerCallback):
    """Prints the mean reward of each step and keeps it."""

    def __init__(self):
        self.rewards: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])
            calls = logs.get("tools/call_frequency", 0.0)
            print(f"step {state.global_step:3d}  reward {logs['reward']:.3f}  tool calls per rollout {calls:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps (default: 12)")
    parser.add_argument("--output-dir", default="agent_trl_output", help="where the trainer's files go")
    parser.add_argument("--worker", default=None, help="use a running rollout-worker (--model tiny-agent) instead")
    parser.add_argument("--colocate", action="store_true", help="generate in the trainer's process (no worker)")
    args = parser.parse_args(argv)
    if args.colocate and args.worker:
        parser.error("--colocate runs no worker: it cannot be combined with --worker")
    if args.steps < 5:
        parser.error("--steps must be at least 5 (the first and last 5 steps' rewards are compared)")
    torch.manual_seed(0)
    model, tokenizer = scripted_agent(CALLS, noise=0.01)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "lm_head.weight")  # train the head: which turn pays; the script's layer stays
    address = args.worker or f"tcp://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    worker = None if args.worker or args.colocate else start_worker(address, model="tiny-agent")
    rollout = dict(rollout_mode="colocate") if args.colocate else dict(rollout_workers=address)
    trainer = None
    try:
        log = RewardLog()
        # the main job's GRPOConfig (fp32, temperature 1, lr 3e-3, 16 rows a step), with room for two turns
        config = toy_grpo_config(
            args.output_dir, args.steps, num_generations=4, max_completion_length=128, disable_tqdm=True
        )
        trainer = RolloutGRPOTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": "Use the tool."}]] * 64, "a": [3] * 64, "b": [4] * 64}
            ),
            processing_class=tokenizer,
            environment_factory=Calculator,
            callbacks=[log],
            **rollout,
        )
        trainer.remove_callback(PrinterCallback)  # RewardLog prints the step's reward instead of every metric
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if worker is not None:
            worker.terminate()
            worker.wait(30)
    first, last = sum(log.rewards[:5]) / 5, sum(log.rewards[-5:]) / 5
    print(
        f"\nmean reward, first 5 steps: {first:.3f}; last 5 steps: {last:.3f} ({time.perf_counter() - started:.0f} s)"
    )
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main())

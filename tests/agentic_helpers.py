"""What the agentic TRL tests share: the scripted tool caller with noise under its script, TRL's test tools and
environments, a recorder of what TRL handed its reward functions, and the checks against TRL's own metrics."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
from datasets import Dataset  # noqa: E402

from rollout.presets import scripted_agent  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trl_helpers import grpo_config  # noqa: E402

IS_TOLERANCE = 1e-3  # the bound on TRL's step-1 importance ratio, fp32, worker in another process


def agent(**script):
    """The scripted tool caller over small random weights: every weight takes part in the forward and log-probs are
    not round numbers (the script's choices still lead by ~30 logits), so a train/inference mismatch would show."""
    return scripted_agent(**script, noise=0.01)


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def conversations(count: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is 3 times {i}?"}] for i in range(count)]})


class Recorder:
    """A reward function that keeps what TRL handed it (completions as messages, environments), and TRL's rounds
    (`_generate_and_score_completions`' output) once `watch`es a trainer."""

    __name__ = "recorded_reward"

    def __init__(self, reward: Callable[..., list[float]] | None = None):
        self.completions: list[list[dict]] = []
        self.environments: list[object] = []
        self.rounds: list[dict] = []
        self.generate_calls = 0
        self.reward = reward

    def __call__(self, completions, completion_ids, environments=None, **kwargs):
        self.completions += completions
        self.environments += environments or []
        if self.reward is not None:
            return self.reward(completions=completions, environments=environments)
        return [float(len(ids)) / 8 for ids in completion_ids]

    def watch(self, trainer: RolloutGRPOTrainer) -> RolloutGRPOTrainer:
        generate_and_score = trainer._generate_and_score_completions

        def recorded(inputs):
            output = generate_and_score(inputs)
            self.rounds.append(output)
            return output

        trainer._generate_and_score_completions = recorded
        generate = trainer.rollout.generate

        def counted(*args, **kwargs):
            self.generate_calls += 1
            return generate(*args, **kwargs)

        trainer.rollout.generate = counted  # what TRL calls once per turn of a round
        return trainer


def calls_and_failures(completions: list[list[dict]]) -> tuple[int, int]:
    """(tool calls made, calls whose tool message reports an error) over TRL's completions, as messages."""
    calls = sum(len(message.get("tool_calls") or []) for turns in completions for message in turns)
    failures = sum(
        message["role"] == "tool" and str(message["content"]).startswith("{'error'")
        for turns in completions
        for message in turns
    )
    return calls, failures


def last_log(trainer: RolloutGRPOTrainer) -> dict:
    return [entry for entry in trainer.state.log_history if "loss" in entry][-1]


def check_tool_metrics(trainer: RolloutGRPOTrainer, recorder: Recorder, rows_per_step: int) -> None:
    """TRL's tool metrics of the last step equal what its completions show; some row ran two turns."""
    step = recorder.completions[-rows_per_step:]
    calls, failures = calls_and_failures(step)
    log = last_log(trainer)
    assert log["tools/call_frequency"] == pytest.approx(calls / rows_per_step), step
    assert log["tools/failure_frequency"] == pytest.approx(failures / calls if calls else 0.0), step
    answered = [turns for turns in recorder.completions if [m["role"] for m in turns][-2:] == ["tool", "assistant"]]
    assert answered, "the loop never ran a second turn"
    assert all(turns[-1]["content"] == "Done!" for turns in answered)  # the script's answer once a result is in


def check_tool_mask(trainer: RolloutGRPOTrainer, recorder: Recorder) -> None:
    """In every round TRL trained on, each run of tokens its tool mask drops is exactly the template's rendering of
    a tool turn (between a call and the next turn), and no logprob was sampled for them."""
    tokenizer = trainer.processing_class
    tool_turns = 0
    for output in recorder.rounds:
        for ids, mask, keep, logps in zip(
            output["completion_ids"], output["completion_mask"], output["tool_mask"], output["sampling_per_token_logps"]
        ):
            real = mask.bool()
            ids, keep, logps = ids[real].tolist(), keep[real].tolist(), logps[real].tolist()
            runs = itertools.groupby(range(len(ids)), key=lambda i: keep[i])
            for kept, positions in runs:
                positions = list(positions)
                if kept:
                    continue
                tool_turns += 1
                text = tokenizer.decode([ids[i] for i in positions])
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n"), text
                assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
                assert all(logps[i] == 0 for i in positions)
    assert tool_turns, "no round held a tool turn"


def check_importance_ratio(trainer: RolloutGRPOTrainer) -> None:
    """TRL's own step-1 importance ratio over the tokens it trains on (tool tokens masked): 1 within 1e-3."""
    first = [entry for entry in trainer.state.log_history if "loss" in entry][0]
    for stat in ("min", "mean", "max"):
        assert abs(first[f"sampling/importance_sampling_ratio/{stat}"] - 1) <= IS_TOLERANCE, first
    assert first["sampling/sampling_logp_difference/max"] <= IS_TOLERANCE


def train(worker, tmp_path, model, tokenizer, recorder, rows: int = 6, **trainer_kwargs) -> RolloutGRPOTrainer:
    """A 2-step server-mode run of `rows` rows per step (one group) on `worker`, recorded by `recorder`."""
    settings = dict(per_device_train_batch_size=rows, num_generations=3, max_completion_length=256, learning_rate=1e-4)
    settings.update(trainer_kwargs.pop("config", {}))
    if "rollout_mode" not in trainer_kwargs:
        trainer_kwargs["rollout_workers"] = worker.address
    trainer = RolloutGRPOTrainer(
        model=model,
        reward_funcs=trainer_kwargs.pop("reward_funcs", recorder),
        args=grpo_config(tmp_path, **settings),
        processing_class=tokenizer,
        **trainer_kwargs,
    )
    recorder.watch(trainer).train()
    return trainer


class CounterEnvironment:
    """TRL's DummyEnvironment: a counter its tool increments."""

    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class RewardingCounter(CounterEnvironment):
    def get_reward(self) -> float:
        return float(self._counter)


COUNTER_CALLS = [{"name": "increment", "arguments": {"step": 1}}, {"name": "decrement", "arguments": {"step": 2}}]


def successful_calls(turns: list[dict]) -> list[str]:
    return [m["name"] for m in turns if m["role"] == "tool" and not str(m["content"]).startswith("{'error'")]

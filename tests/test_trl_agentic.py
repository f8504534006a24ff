"""TRL's own tool loop (`tools=`, `environment_factory=`) through `RolloutGRPOTrainer`: TRL's tests for it in
`tests/test_grpo_trainer.py` (TRL 1.16), ported. Where TRL patches `model.generate` to return fixed token ids, these
sample from `scripted_agent` (the `tiny-agent` preset), whose logits really call the tools in its chat template's
format (or refuse, each a third), then answer once a tool result is in the conversation, so the loop runs two
turns. Sampling decides which rows call which tool, so TRL's tool metrics are checked against the completions TRL
handed its own reward functions rather than TRL's fixed fractions.

References: TRL's metrics (`tools/*`; its importance ratio and logprob difference, which it computes over the tokens
its tool mask keeps), the chat template's own rendering of a tool turn, and the environments' own state."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
from datasets import Dataset  # noqa: E402

from rollout.service.agent_preset import scripted_agent  # noqa: E402
from rollout.service.presets import tiny_moe_model  # noqa: E402
from service_helpers import Worker  # noqa: E402
from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trl_helpers import grpo_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def worker():
    """One rollout-worker serving the tiny-agent preset; each test's trainer pushes its own script's weights."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        server = Worker("--model", "tiny-agent")
    yield server
    server.close()


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


# ---- TRL's test_train_with_tools ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", [multiply_tool, async_multiply_tool])
def test_train_with_tools(tool, worker, tmp_path):
    # ported: two valid/invalid calls of the tool (wrong argument name) and a refusal, sampled instead of patched in
    name = tool.__name__
    model, tokenizer = agent(
        calls=[{"name": name, "arguments": {"a": 3, "b": 4}}, {"name": name, "arguments": {"a": 3, "c": 4}}]
    )
    recorder = Recorder()
    config = grpo_config(
        tmp_path, per_device_train_batch_size=3, num_generations=3, max_completion_length=256, learning_rate=1e-4
    )
    trainer = recorder.watch(
        RolloutGRPOTrainer(
            model=model,
            reward_funcs=recorder,
            args=config,
            train_dataset=conversations(),
            processing_class=tokenizer,
            tools=[tool],
            rollout_workers=worker.address,
        )
    )
    trainer.train()
    check_tool_metrics(trainer, recorder, rows_per_step=3)
    check_tool_mask(trainer, recorder)
    check_importance_ratio(trainer)
    assert all(entry["rollout/policy_lag_max"] == 0 for entry in trainer.state.log_history if "loss" in entry)
    for turns in recorder.completions:  # a valid call's result is the product
        for message in turns:
            if message["role"] == "tool" and not str(message["content"]).startswith("{'error'"):
                assert message["content"] == "12"


def train(worker, tmp_path, model, tokenizer, recorder, rows: int = 3, **trainer_kwargs) -> RolloutGRPOTrainer:
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


# ---- TRL's test_train_with_environment_factory --------------------------------------------------------------------
def test_train_with_environment_factory(worker, tmp_path):
    # ported: a valid increment, a call of a tool the environment lacks, and a refusal; no dataset (max_steps)
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(worker, tmp_path, model, tokenizer, recorder, environment_factory=CounterEnvironment)
    check_tool_metrics(trainer, recorder, rows_per_step=3)
    check_tool_mask(trainer, recorder)
    check_importance_ratio(trainer)
    # each environment's state is what its rollout's calls did: +1 per successful increment
    last = recorder.completions[-3:]
    assert [env._counter for env in trainer.environments] == [len(successful_calls(turns)) for turns in last]
    assert recorder.environments[-3:] == trainer.environments


# ---- TRL's test_train_with_environment_owned_reward ---------------------------------------------------------------
def test_train_with_environment_owned_reward(worker, tmp_path):
    # ported: no reward_funcs; the environment's get_reward (its counter) is the reward, logged under its class name
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(
        worker, tmp_path, model, tokenizer, recorder, reward_funcs=None, environment_factory=RewardingCounter
    )
    counters = [env._counter for env in trainer.environments]
    assert last_log(trainer)["rewards/RewardingCounter/mean"] == pytest.approx(sum(counters) / len(counters))
    check_tool_mask(trainer, recorder)


# ---- TRL's test_train_with_multiple_environments ------------------------------------------------------------------
def test_train_with_multiple_environments(worker, tmp_path):
    # ported: a dict environment_factory; each row's `environment` picks its environment, and only that one's tools
    # are its tools: the script calls either environment's tool, so a call of the other one's fails by name
    reset_kwargs_seen = []

    class EchoEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen.append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            return text.upper()

    calls = [{"name": "increment", "arguments": {"step": 1}}, {"name": "shout", "arguments": {"text": "hi"}}]
    model, tokenizer = agent(calls=calls)
    recorder = Recorder()
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 8})
    trainer = train(
        worker,
        tmp_path,
        model,
        tokenizer,
        recorder,
        rows=6,
        config=dict(shuffle_dataset=False),
        train_dataset=dataset,
        environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment},
    )
    assert [tool.__name__ for tool in trainer._env_tools["counter"]] == ["increment"]
    assert [tool.__name__ for tool in trainer._env_tools["echo"]] == ["shout"]
    own_tool = {CounterEnvironment: "increment", EchoEnvironment: "shout"}
    for turns, environment in zip(recorder.completions, recorder.environments):
        assert set(successful_calls(turns)) <= {own_tool[type(environment)]}
        for message in turns:
            if message["role"] == "tool" and message["name"] != own_tool[type(environment)]:
                assert message["content"] == f"{{'error': 'Tool {message['name']} not found.'}}"
    assert reset_kwargs_seen and all("environment" not in kwargs for kwargs in reset_kwargs_seen)
    # "Echo." was appended to the echo rows' user turn by reset(); the counter rows' reset returned nothing
    echo_prompts = [round_["prompt_ids"] for round_ in recorder.rounds]
    assert any("Echo." in tokenizer.decode(ids) for prompts in echo_prompts for ids in prompts)
    check_tool_mask(trainer, recorder)


# ---- the other modes ------------------------------------------------------------------------------------------------
def test_tools_in_colocated_mode(tmp_path):
    """Colocated (no worker): the tool loop runs in the trainer's own engine; the ratio is 1 to fp32 rounding."""
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(
        None, tmp_path, model, tokenizer, recorder, rollout_mode="colocate", environment_factory=CounterEnvironment
    )
    check_tool_metrics(trainer, recorder, rows_per_step=3)
    check_tool_mask(trainer, recorder)
    first = [entry for entry in trainer.state.log_history if "loss" in entry][0]
    assert first["sampling/sampling_logp_difference/max"] <= 1e-5


def test_tools_with_max_staleness(worker, tmp_path):
    """max_staleness=1 with tools: the first turn of the next round is sent ahead (generated under older weights:
    the lag says so), later turns when TRL asks; TRL's tool metrics and mask are as in synchronous runs."""
    model, tokenizer = agent(calls=COUNTER_CALLS[:1] + [{"name": "multiply_tool", "arguments": {"a": 3}}])
    recorder = Recorder()
    trainer = train(
        worker,
        tmp_path,
        model,
        tokenizer,
        recorder,
        config=dict(max_steps=3),
        train_dataset=conversations(),
        tools=[multiply_tool],
        max_staleness=1,
    )
    check_tool_metrics(trainer, recorder, rows_per_step=3)
    check_tool_mask(trainer, recorder)
    assert max(entry["rollout/policy_lag_max"] for entry in trainer.state.log_history if "loss" in entry) <= 1
    assert trainer.rollout.num_unmatched_rounds >= 1  # later turns were not sent ahead


def test_environment_factory_with_max_staleness_warns_and_trains(worker, tmp_path):
    model, tokenizer = agent(calls=COUNTER_CALLS)
    with pytest.warns(UserWarning, match="nothing is sent ahead"):
        trainer = train(
            worker,
            tmp_path,
            model,
            tokenizer,
            Recorder(),
            environment_factory=CounterEnvironment,
            max_staleness=1,
        )
    assert trainer.state.global_step == 2 and not trainer.rollout._ahead


def test_what_cannot_carry_a_tool_loop_is_refused_by_name(worker, tmp_path):
    model, tokenizer = agent()
    with pytest.raises(ValueError, match="partial_rollouts=True does not support tools"):
        train(
            worker,
            tmp_path,
            model,
            tokenizer,
            Recorder(),
            train_dataset=conversations(),
            tools=[multiply_tool],
            partial_rollouts=True,
            max_staleness=1,
        )
    with pytest.raises(ValueError, match="routing_replay=True does not support rollout_func, tools"):
        train(
            worker,
            tmp_path,
            tiny_moe_model(0),
            tokenizer,
            Recorder(),
            train_dataset=conversations(),
            tools=[multiply_tool],
            routing_replay=True,
        )


# ---- examples/agent_trl.py ------------------------------------------------------------------------------------------
def test_agent_trl_example(worker, tmp_path, capsys):
    """The example on this module's worker: TRL's environment loop through rollout, and the environment's reward
    (a right product from a well-formed call) rises from the script's 0.25 as GRPO trains the head."""
    spec = importlib.util.spec_from_file_location("agent_trl_under_test", REPO / "examples" / "agent_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--worker", worker.address, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rewards = [float(r) for r in re.findall(r"step\s+\d+\s+reward ([\d.]+)", out)]
    assert len(rewards) == 12
    first, last = re.search(r"first 5 steps: ([\d.]+); last 5 steps: ([\d.]+)", out).groups()
    assert float(first) == pytest.approx(sum(rewards[:5]) / 5, abs=2e-3)
    assert float(last) == pytest.approx(sum(rewards[-5:]) / 5, abs=2e-3)
    assert float(last) - float(first) > 0.2

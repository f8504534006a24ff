"""TRL's own tool loop (`tools=`, `environment_factory=`) through `RolloutGRPOTrainer`: TRL's tests for it in
`tests/test_grpo_trainer.py` (TRL 1.16), ported. Where TRL patches `model.generate` to return fixed token ids, these
sample from `scripted_agent` (the `tiny-agent` preset), whose logits really call the tools in its chat template's
format (or refuse, each a third), then answer once a tool result is in the conversation, so the loop runs two
turns. Sampling decides which rows call which tool, so TRL's tool metrics are checked against the completions TRL
handed its own reward functions rather than TRL's fixed fractions.

References: TRL's metrics (`tools/*`; its importance ratio and logprob difference, which it computes over the tokens
its tool mask keeps), the chat template's own rendering of a tool turn, and the environments' own state."""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
from agentic_helpers import (  # noqa: E402
    COUNTER_CALLS,
    CounterEnvironment,
    Recorder,
    RewardingCounter,
    agent,
    async_multiply_tool,
    check_importance_ratio,
    check_tool_mask,
    check_tool_metrics,
    conversations,
    last_log,
    multiply_tool,
    successful_calls,
    train,
)
from datasets import Dataset  # noqa: E402

from trainer_bridge.trl import RolloutGRPOTrainer  # noqa: E402
from trl_helpers import grpo_config  # noqa: E402


# ---- TRL's test_train_with_tools ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", [multiply_tool, async_multiply_tool])
def test_train_with_tools(tool, agent_worker, tmp_path):
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
            rollout_workers=agent_worker.address,
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


# ---- TRL's test_train_with_environment_factory --------------------------------------------------------------------
def test_train_with_environment_factory(agent_worker, tmp_path):
    # ported: a valid increment, a call of a tool the environment lacks, and a refusal; no dataset (max_steps)
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(agent_worker, tmp_path, model, tokenizer, recorder, environment_factory=CounterEnvironment)
    check_tool_metrics(trainer, recorder, rows_per_step=3)
    check_tool_mask(trainer, recorder)
    check_importance_ratio(trainer)
    # each environment's state is what its rollout's calls did: +1 per successful increment
    last = recorder.completions[-3:]
    assert [env._counter for env in trainer.environments] == [len(successful_calls(turns)) for turns in last]
    assert recorder.environments[-3:] == trainer.environments


# ---- TRL's test_train_with_environment_owned_reward ---------------------------------------------------------------
def test_train_with_environment_owned_reward(agent_worker, tmp_path):
    # ported: no reward_funcs; the environment's get_reward (its counter) is the reward, logged under its class name
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(
        agent_worker, tmp_path, model, tokenizer, recorder, reward_funcs=None, environment_factory=RewardingCounter
    )
    counters = [env._counter for env in trainer.environments]
    assert last_log(trainer)["rewards/RewardingCounter/mean"] == pytest.approx(sum(counters) / len(counters))
    check_tool_mask(trainer, recorder)


# ---- TRL's test_train_with_multiple_environments ------------------------------------------------------------------
def test_train_with_multiple_environments(agent_worker, tmp_path):
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
        agent_worker,
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

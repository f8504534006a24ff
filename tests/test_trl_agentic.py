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
        tmp_path, per_device_train_batch_size=6, num_generations=3, max_completion_length=256, learning_rate=1e-4
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
    check_tool_metrics(trainer, recorder, rows_per_step=6)
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
    check_tool_metrics(trainer, recorder, rows_per_step=6)
    check_tool_mask(trainer, recorder)
    check_importance_ratio(trainer)
    # each environment's state is what its rollout's calls did: +1 per successful increment
    last = recorder.completions[-6:]
    assert [env._counter for env in trainer.environments] == [len(successful_calls(turns)) for turns in last]
    assert recorder.environments[-6:] == trainer.environments


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


# ---- TRL's test_train_with_unknown_environment_raises -------------------------------------------------------------
def test_train_with_unknown_environment_raises(agent_worker, tmp_path):
    # ported: an example whose `environment` names no configured environment fails with TRL's clear error
    model, tokenizer = agent(calls=COUNTER_CALLS)
    dataset = conversations().map(lambda example: {"environment": "unknown"})
    with pytest.raises(ValueError, match="not among the environments"):
        train(
            agent_worker,
            tmp_path,
            model,
            tokenizer,
            Recorder(),
            train_dataset=dataset,
            environment_factory={"counter": CounterEnvironment},
        )


# ---- TRL's test_train_with_environment_owned_data -----------------------------------------------------------------
def test_train_with_environment_owned_data(agent_worker, tmp_path):
    # ported: no dataset; reset() returns the prompt and max_steps drives the loop (the environment has no tools, so
    # the script's calls stay text: one turn)
    class GuessTheWordEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(agent_worker, tmp_path, model, tokenizer, recorder, environment_factory=GuessTheWordEnvironment)
    assert trainer.state.global_step == 2 and len(recorder.completions) == 12
    prompts = [tokenizer.decode(ids) for round_ in recorder.rounds for ids in round_["prompt_ids"]]
    assert all("Guess the 5-letter word." in prompt for prompt in prompts)
    assert all(len(turns) == 1 for turns in recorder.completions)  # no tool loop without tools


# ---- TRL's test_train_with_malformed_tool_calls -------------------------------------------------------------------
def test_train_with_malformed_tool_calls(agent_worker, tmp_path):
    # ported: calls without a name, and with unquoted keys (not JSON), inside the tags: no tool runs and no second
    # turn is sampled; training goes on
    malformed = ['{"arguments": {"a": 3, "b": 4}}', '{"arguments": {a: 3, b: 4}}']
    model, tokenizer = agent(calls=malformed)
    recorder = Recorder()
    trainer = train(
        agent_worker, tmp_path, model, tokenizer, recorder, train_dataset=conversations(), tools=[multiply_tool]
    )
    assert trainer.state.global_step == 2
    assert all(message["role"] == "assistant" for turns in recorder.completions for message in turns)
    assert all(not output["tool_mask"].eq(0).any() for output in recorder.rounds)


# ---- TRL's construction checks, through RolloutGRPOTrainer ---------------------------------------------------------
def test_environment_owned_reward_coexists_with_reward_funcs(agent_worker, tmp_path):
    # ported: get_reward is appended after the trainer-owned reward funcs with weight 1, and is not a tool
    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    model, tokenizer = agent(calls=COUNTER_CALLS)
    trainer = RolloutGRPOTrainer(
        model=model,
        reward_funcs=format_reward,
        args=grpo_config(tmp_path, per_device_train_batch_size=3, num_generations=3, reward_weights=[0.5]),
        processing_class=tokenizer,
        environment_factory=RewardingCounter,
        rollout_workers=agent_worker.address,
    )
    assert trainer.reward_func_names == ["format_reward", "RewardingCounter"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert [tool.__name__ for tool in trainer.tools] == ["increment"]
    trainer.rollout_client.close()


@pytest.mark.parametrize(
    ("factory", "config", "match"),
    [
        (None, {}, "`train_dataset` is required"),
        (CounterEnvironment, {"max_steps": -1}, "max_steps"),
        ({"a": CounterEnvironment, "b": RewardingCounter}, {}, "requires a `train_dataset`"),
    ],
    ids=["dataset_required_without_environment", "environment_owned_data_requires_max_steps", "multiple_no_dataset"],
)
def test_what_trl_refuses_at_construction_is_refused(agent_worker, tmp_path, factory, config, match):
    # ported: TRL's own construction errors, unchanged through RolloutGRPOTrainer
    model, tokenizer = agent(calls=COUNTER_CALLS)
    with pytest.raises(ValueError, match=match):
        RolloutGRPOTrainer(
            model=model,
            reward_funcs=Recorder(),
            args=grpo_config(tmp_path, per_device_train_batch_size=3, num_generations=3, **config),
            processing_class=tokenizer,
            environment_factory=factory,
            rollout_workers=agent_worker.address,
        )


# ---- TRL's test_train_with_tools_multimodal_response: refused -----------------------------------------------------
def test_a_tool_that_returns_an_image_is_refused_by_name(agent_worker, tmp_path):
    # not portable: rollout workers serve text-only models, so a tool result with an image cannot be generated from
    def snapshot(a: int, b: int) -> list:
        """
        Takes a picture.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The picture.
        """
        from PIL import Image

        return [{"type": "image", "image": Image.new("RGB", (8, 8))}, {"type": "text", "text": "here"}]

    model, tokenizer = agent(calls=[{"name": "snapshot", "arguments": {"a": 3, "b": 4}}])
    with pytest.raises(NotImplementedError, match="images are not supported"):
        train(agent_worker, tmp_path, model, tokenizer, Recorder(), train_dataset=conversations(), tools=[snapshot])

"""TRL's tool loop through `RolloutGRPOTrainer` in its other modes (colocate, max_staleness), what refuses it, and
`examples/agent_trl.py`; on the scripted tool caller, checked against TRL's own metrics as in test_trl_agentic.py."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
from agentic_helpers import (  # noqa: E402
    COUNTER_CALLS,
    CounterEnvironment,
    Recorder,
    agent,
    check_tool_mask,
    check_tool_metrics,
    conversations,
    multiply_tool,
    train,
)

from rollout.presets import tiny_moe_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ---- the other modes ------------------------------------------------------------------------------------------------
def test_tools_in_colocated_mode(tmp_path):
    """Colocated (no worker): the tool loop runs in the trainer's own engine; the ratio is 1 to fp32 rounding."""
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    trainer = train(
        None, tmp_path, model, tokenizer, recorder, rollout_mode="colocate", environment_factory=CounterEnvironment
    )
    check_tool_metrics(trainer, recorder, rows_per_step=6)
    check_tool_mask(trainer, recorder)
    first = [entry for entry in trainer.state.log_history if "loss" in entry][0]
    assert first["sampling/sampling_logp_difference/max"] <= 1e-5


def test_tools_with_max_staleness(agent_worker, tmp_path):
    """max_staleness=1 with tools: the first turn of the next round is sent ahead (generated under older weights:
    the lag says so), later turns when TRL asks; TRL's tool metrics and mask are as in synchronous runs."""
    model, tokenizer = agent(calls=COUNTER_CALLS[:1] + [{"name": "multiply_tool", "arguments": {"a": 3}}])
    recorder = Recorder()
    trainer = train(
        agent_worker,
        tmp_path,
        model,
        tokenizer,
        recorder,
        train_dataset=conversations(),
        tools=[multiply_tool],
        max_staleness=1,
    )
    check_tool_metrics(trainer, recorder, rows_per_step=6)
    check_tool_mask(trainer, recorder)
    assert max(entry["rollout/policy_lag_max"] for entry in trainer.state.log_history if "loss" in entry) <= 1
    # Of TRL's generate calls (2 rounds, each a first turn and later turns), all but round 2's first turn were
    # generated when asked: that one was sent ahead while round 1 trained.
    assert recorder.generate_calls >= 3
    assert trainer.rollout.num_unmatched_rounds == recorder.generate_calls - 1


def test_environment_factory_with_max_staleness_warns_and_trains(agent_worker, tmp_path):
    model, tokenizer = agent(calls=COUNTER_CALLS)
    recorder = Recorder()
    with pytest.warns(UserWarning, match="nothing is sent ahead"):
        trainer = train(
            agent_worker,
            tmp_path,
            model,
            tokenizer,
            recorder,
            environment_factory=CounterEnvironment,
            max_staleness=1,
        )
    assert trainer.state.global_step == 2
    assert trainer.rollout.num_unmatched_rounds == recorder.generate_calls >= 2  # every turn generated when asked
    check_tool_mask(trainer, recorder)


class PromptingEnvironment:
    """An environment with no tools: its reset() writes the prompt (TRL's environment-owned data)."""

    def reset(self, **kwargs):
        return "Guess the word."


@pytest.mark.parametrize(
    "loop",
    [dict(train_dataset=conversations(), tools=[multiply_tool]), dict(environment_factory=PromptingEnvironment)],
    ids=["tools", "environment_without_tools"],
)
def test_what_cannot_carry_a_tool_loop_is_refused_by_name(agent_worker, tmp_path, loop):
    model, tokenizer = agent()
    with pytest.raises(ValueError, match="partial_rollouts=True does not support tools or environment_factory"):
        train(agent_worker, tmp_path, model, tokenizer, Recorder(), partial_rollouts=True, max_staleness=1, **loop)
    with pytest.raises(ValueError, match="routing_replay=True does not support rollout_func, tools"):
        train(agent_worker, tmp_path, tiny_moe_model(0), tokenizer, Recorder(), routing_replay=True, **loop)


# ---- examples/agent_trl.py ------------------------------------------------------------------------------------------
def test_agent_trl_example(agent_worker, tmp_path, capsys):
    """The example on the shared tiny-agent worker: TRL's environment loop through rollout, and the environment's reward
    (a right product from a well-formed call) rises from the script's 1/3 as GRPO trains the head."""
    spec = importlib.util.spec_from_file_location("agent_trl_under_test", REPO / "examples" / "agent_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--worker", agent_worker.address, "--steps", "12", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rewards = [float(r) for r in re.findall(r"step\s+\d+\s+reward ([\d.]+)", out)]
    assert len(rewards) == 12  # the example's default: 10 steps left the rise to chance
    first, last = re.search(r"first 5 steps: ([\d.]+); last 5 steps: ([\d.]+)", out).groups()
    assert float(first) == pytest.approx(sum(rewards[:5]) / 5, abs=2e-3)
    assert float(last) == pytest.approx(sum(rewards[-5:]) / 5, abs=2e-3)
    # The untrained script calls right a third of the time. Its first five steps' mean already includes some learning
    # (0.44-0.64 in runs here), its last five's 0.81-0.89: the rise between them varies with the run (0.20-0.39).
    assert float(last) > max(float(first), 0.6)

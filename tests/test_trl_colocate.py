"""RolloutGRPOTrainer(rollout_mode="colocate"): each rank generates in its own process on the model it trains.

References: TRL's own teacher-forced logprobs (its `sampling/*` metrics), transformers' greedy `generate` of the
trained model, and what each rank of a 2-process (gloo) run generated and trained."""

from __future__ import annotations

import importlib.util
import json
import re
import textwrap

import pytest
import torch
from transformers import TrainerCallback

import trainer_bridge.trl.generation as bridge
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.presets import tiny_model
from service_helpers import run_ranks
from test_trl import GREEDY_PROMPTS, IS_METRICS, REPO, TOKENIZER, hf_greedy, train_logs
from trainer_bridge import PromptGroup
from trainer_bridge.trl import RolloutGRPOTrainer
from trainer_bridge.trl.colocated_mode import ColocatedGeneration
from trl_helpers import dataset, grpo_config, id_reward


class CacheAtOptimizerStep(TrainerCallback):
    """Records whether the colocated engine's KV cache was asleep when each optimizer step began."""

    def __init__(self):
        self.trainer = None
        self.sleeping: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.sleeping.append(self.trainer.rollout.engine.is_sleeping)


def no_push(*args, **kwargs):
    raise AssertionError("colocated training pushed weights")


@pytest.mark.timeout(180)
def test_grpo_steps_colocated_without_a_worker(tmp_path, monkeypatch):
    """Two GRPO steps with no worker and no push, under top_p / top_k truncation: TRL's own importance ratio is 1
    and its per-token |sampling - teacher-forced| logprob difference at most 1e-5 (fp32, the same model in the same
    process); the cache sleeps through every optimizer step; the trained weights are what the engine samples next."""
    monkeypatch.setattr(bridge, "push_weights", no_push)
    probe = CacheAtOptimizerStep()
    truncating = dict(temperature=0.7, top_p=0.9, top_k=20)
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, **truncating),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        sleep_between_rounds=True,
        callbacks=[probe],
    )
    probe.trainer = trainer
    assert isinstance(trainer.rollout, ColocatedGeneration) and trainer.rollout_client is None
    assert trainer.rollout.sampling["logprob_mode"] == "temperature_scaled"
    trainer.train()
    engine = trainer.rollout.engine
    assert trainer.state.global_step == 2 and engine.num_rounds == 2 and engine.policy_version == 1
    assert probe.sleeping == [True, True]

    logs = train_logs(trainer)
    assert len(logs) == 2
    for entry in logs:
        for name in IS_METRICS:
            assert abs(entry[name] - 1) < 1e-4, (name, entry)
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-5, entry
        assert entry["rollout/policy_lag_mean"] == 0.0 and entry["rollout/policy_lag_max"] == 0.0
    assert any(entry["grad_norm"] > 0 for entry in logs)

    trained = trainer.accelerator.unwrap_model(trainer.model)
    greedy = SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=())
    results = engine.generate([PromptGroup(prompt, 1, greedy) for prompt in GREEDY_PROMPTS])
    assert [r.completions[0].token_ids for r in results] == hf_greedy(trained, GREEDY_PROMPTS)
    assert trained.training  # TRL's model is back in training mode after every round


@pytest.mark.timeout(180)
def test_mixed_precision_and_a_second_train_call(tmp_path):
    """TRL's default bf16 mixed precision (accelerate's autocast around the fp32 model's forward) reaches the
    engine's forwards too: the rounds sample without error, in the trainer's own numerics (IS ratio 1 within bf16
    noise). A second `train()` starts the step count again: versions keep growing and the lag stays 0."""
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, bf16=True, max_steps=1),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
    )
    trainer.train()
    logs = train_logs(trainer)
    trainer.train()  # each train() starts a new log history
    logs += train_logs(trainer)
    assert trainer.rollout.engine.num_rounds == 2 and trainer.rollout.engine.policy_version == 1
    assert len(logs) == 2
    for entry in logs:
        assert abs(entry["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2, entry
        assert entry["rollout/policy_lag_max"] == 0.0


@pytest.mark.timeout(180)
def test_cast_lm_head_to_fp32_under_mixed_precision_samples_with_the_fp32_head_trl_scores_with(tmp_path):
    """TRL's cast_lm_head_to_fp32 scores the completions with its head in fp32, outside the bf16 autocast (its fused
    head). The rounds computed their head under that autocast, in bf16 (an fp32_logits engine too: its fp32 head
    was applied only to a head whose weight is not fp32, and its product was autocast back to bf16): TRL's per-token
    |sampling - teacher-forced| difference was 7.5e-4 on average. Now the rounds' head is fp32 as TRL's is."""
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, bf16=True, cast_lm_head_to_fp32=True, max_steps=1),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=ContinuousBatchingConfig(num_blocks=128, block_size=16),
    )
    trainer.train()
    trainer.close()
    (entry,) = train_logs(trainer)
    assert entry["sampling/sampling_logp_difference/mean"] < 2e-4, entry  # (measured: 3.8e-5)


def test_each_setting_belongs_to_its_mode(tmp_path):
    """A setting of the other mode would have no effect: refused by name before the trainer is built."""
    common = dict(model=None, reward_funcs=id_reward, args=grpo_config(tmp_path))
    cases = [
        (dict(rollout_mode="vllm"), "rollout_mode must be one of"),
        (dict(), 'rollout_mode="server" \\(the default\\) needs rollout_workers: .* or rollout_mode="colocate"'),
        (dict(rollout_workers="tcp://x:1", sleep_between_rounds=True), "sleep_between_rounds has no effect"),
        (dict(rollout_workers="tcp://x:1", sleep_between_rounds=False), "sleep_between_rounds has no effect"),
        (dict(rollout_workers="tcp://x:1", rollout_engine_config={}), "rollout_engine_config has no effect"),
        (dict(rollout_mode="colocate", rollout_workers="tcp://x:1"), "rollout_workers has no effect"),
        (dict(rollout_mode="colocate", rollout_push_kwargs={}), "rollout_push_kwargs has no effect"),
        # a typo in rollout_push_kwargs is named when the trainer is built, not at its first push
        (dict(rollout_workers="tcp://x:1", rollout_push_kwargs={"mdoe": "keep"}), "push_weights takes no 'mdoe'"),
        (dict(rollout_workers="tcp://x:1", rollout_push_kwargs={"version": 3}), "version: the trainer sets it"),
        # and a value push_weights cannot take
        (dict(rollout_workers="tcp://x:1", rollout_push_kwargs={"adapters": "bogus"}), "adapters must be one of"),
        (dict(rollout_workers="tcp://x:1", rollout_push_kwargs={"transport": "pigeon"}), "transport must be one of"),
        (dict(rollout_workers="tcp://x:1", rollout_push_kwargs={"mode": "sometimes"}), "mode must be one of"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            RolloutGRPOTrainer(**common, **settings)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rollout_worker'; did you mean 'rollout_workers'"):
        RolloutGRPOTrainer(**common, rollout_worker="tcp://x:1")
    with pytest.raises(ValueError, match="rollout_engine_config: dict is invalid"):  # the trainer's argument, named
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_mode="colocate",
            rollout_engine_config={"num_blocks": 64},
        )


CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl_helpers import dataset, grpo_config, id_reward

    import trainer_bridge.trl.generation as bridge
    from rollout.presets import tiny_model, tiny_tokenizer
    from trainer_bridge.trl import RolloutGRPOTrainer

    out = sys.argv[1]

    def no_push(*args, **kwargs):
        raise AssertionError("colocated training pushed weights")

    bridge.push_weights = no_push

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0), reward_funcs=id_reward, args=grpo_config(out), train_dataset=dataset(),
        processing_class=tiny_tokenizer(), rollout_mode="colocate", sleep_between_rounds=True,
    )
    rows = []
    generate_rows = trainer.rollout.generate_rows

    def recording_rows(prompt_ids, **sampling):
        result = generate_rows(prompt_ids, **sampling)
        rows.append({"step": trainer.state.global_step, "prompts": prompt_ids,
                     "versions": result.policy_versions})
        return result

    trainer.rollout.generate_rows = recording_rows
    trainer.train()
    rank = trainer.accelerator.process_index
    engine = trainer.rollout.engine
    same_model = engine.model is trainer.accelerator.unwrap_model(trainer.model)
    weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    checksum = float(sum(value.double().abs().sum() for value in weights.values()))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "rows": rows, "rounds": engine.num_rounds,
                   "same_model": same_model, "checksum": checksum,
                   "logs": [e for e in trainer.state.log_history if "loss" in e]}, file)
    """
)


@pytest.mark.timeout(240)
def test_two_ranks_each_generate_their_rows_colocated(tmp_path):
    """torchrun-style, 2 CPU processes (gloo): each rank samples its own rows with an engine on its own model (the
    module it trains), tagged with the step; nothing is pushed; DDP keeps the two models equal."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_ranks(script, [str(tmp_path)])
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world"], r["rounds"], r["same_model"]) for r in results] == [
        (0, 2, 2, True),
        (1, 2, 2, True),
    ]
    for r in results:
        assert [call["step"] for call in r["rows"]] == [0, 1]
        for call in r["rows"]:
            prompts = call["prompts"]
            assert len(prompts) == 8 and all(prompts[i] == prompts[i - i % 4] for i in range(8))  # 2 groups of 4
            assert all(versions == [[call["step"], 0]] for versions in call["versions"])
        for entry in r["logs"]:
            assert entry["rollout/policy_lag_max"] == 0.0 and entry["sampling/sampling_logp_difference/max"] <= 1e-5
    for step in range(2):  # each rank generated its own share of the batch
        assert results[0]["rows"][step]["prompts"] != results[1]["rows"][step]["prompts"]
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-9)


def test_the_model_it_trains_is_the_model_it_samples(tmp_path):
    """The engine holds the trainer's own module (unwrapped), not a copy: no second set of weights in memory."""
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.rollout.engine.model is model
    engine_params = {p.data_ptr() for p in trainer.rollout.engine.model.parameters()}
    assert engine_params == {p.data_ptr() for p in model.parameters()}
    assert torch.equal(next(model.parameters()), next(tiny_model(0).parameters()))


@pytest.mark.timeout(240)
def test_grpo_toy_main_job_colocated(tmp_path, capsys):
    """`python examples/grpo_toy.py --colocate`: the same task with no worker process; the reward rises as in
    server mode."""
    spec = importlib.util.spec_from_file_location("grpo_toy_colocated", REPO / "examples" / "grpo_toy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def no_worker(address):
        raise AssertionError("--colocate started a worker")

    module.start_worker = no_worker
    # 30 steps, not the main job's 100: the reward is near 1.0 by step 30
    assert module.main(["--colocate", "--steps", "30", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "colocated, no worker" in out
    steps = re.findall(r"step\s+(\d+)\s+reward ([\d.]+)\s+policy lag ([\d.]+)", out)
    assert [int(step) for step, _, _ in steps] == list(range(1, 31))
    assert all(float(lag) == 0.0 for _, _, lag in steps)
    (first, last) = re.search(r"mean reward, first 5 steps: ([\d.]+); last 5 steps: ([\d.]+)", out).groups()
    assert float(last) - float(first) > 0.3, out[-2000:]
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

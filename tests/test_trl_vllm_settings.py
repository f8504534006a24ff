"""GRPOConfig settings of TRL's vLLM path that RolloutGRPOTrainer takes over: honoured as TRL's vLLM backend honours
them, or refused in TRL's own words.

- `vllm_max_model_length` in colocate mode caps prompt + completion as vLLM's `max_model_len` does (TRL builds its
  colocated `LLM(max_model_len=...)` from it): a completion ends with finish reason "length" where the two reach
  the cap, with the tokens it had without the cap.
- Without it, vLLM's `max_model_len` is the model's context: a `max_completion_length` past it ends there (it was
  refused), and `max_completion_length=None` runs to it (TRL's vLLM path sends `max_tokens=None`), in both modes.
- `loss_type="vespo"` with the importance-sampling correction needs a token-level mode: TRL's GRPOTrainer checks
  this only when `use_vllm=True`, which RolloutGRPOTrainer is built without.
- `top_k=-1`, vLLM's "no top-k" that TRL passes on to it, is no top-k (rollout's own spelling is 0).
- `rollout_func` passed by position is refused beside `max_staleness` as by keyword.

References: TRL's GRPOTrainer source (its VESPO check, its signature's argument order) and the tokenizer's own
token counts of the dataset's prompts."""

from __future__ import annotations

import inspect

import pytest
from agentic_helpers import agent, conversations, multiply_tool
from trl import GRPOTrainer

from rollout import ContinuousBatchingConfig
from rollout.presets import tiny_model
from service_helpers import Worker
from test_trl import TOKENIZER
from trainer_bridge import ColocatedEngine
from trainer_bridge.trl import RolloutGRPOTrainer
from trl_helpers import dataset, grpo_config, id_reward

ENGINE = ContinuousBatchingConfig(num_blocks=128, block_size=16)
CONTEXT = 300  # a model context past the 256 tokens a request without a length used to get
NO_EOS = {"logit_bias": {TOKENIZER.eos_token_id: -100.0}}  # every completion runs to its length limit


def short_context_model():
    """The tiny model with a context of CONTEXT tokens."""
    model = tiny_model(0)
    model.config.max_position_embeddings = CONTEXT
    return model


def colocated(tmp_path, model=None, **config) -> RolloutGRPOTrainer:
    return RolloutGRPOTrainer(
        model=model or tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, max_steps=1, generation_kwargs=NO_EOS, **config),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=ENGINE,
    )


def served(tmp_path, address: str, **config) -> RolloutGRPOTrainer:
    return RolloutGRPOTrainer(
        model=short_context_model(),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, max_steps=1, generation_kwargs=NO_EOS, **config),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_workers=address,
    )


def sampled_rows(trainer: RolloutGRPOTrainer) -> list[tuple[list[int], list[int], str]]:
    """(prompt, completion, finish reason) of every row the trainer's one step sampled."""
    rows = []
    generate_rows = trainer.rollout.generate_rows

    def recording(prompt_ids, **sampling):
        result = generate_rows(prompt_ids, **sampling)
        rows.extend(zip(prompt_ids, result.completion_ids, result.finish_reasons))
        return result

    trainer.rollout.generate_rows = recording
    trainer.train()
    trainer.close()
    return rows


@pytest.mark.timeout(300)
def test_vllm_max_model_length_caps_prompt_and_completion_in_colocate_mode(tmp_path, monkeypatch):
    """Completions end where prompt + completion reach the cap, with the tokens the uncapped run sampled (the
    same seeds), and are otherwise left to max_completion_length; a prompt leaving no room is refused by name."""
    prompt_tokens = len(TOKENIZER(dataset()["prompt"][0])["input_ids"])
    cap = prompt_tokens + 5  # below prompt + max_completion_length (8)
    uncapped = sampled_rows(colocated(tmp_path / "uncapped"))
    capped = sampled_rows(colocated(tmp_path / "capped", vllm_max_model_length=cap))
    assert [prompt for prompt, _, _ in capped] == [prompt for prompt, _, _ in uncapped]
    for (prompt, full, full_reason), (_, cut, reason) in zip(uncapped, capped):
        assert len(full) == 8 and full_reason == "length"
        assert len(prompt) + len(cut) == cap and reason == "length"
        assert cut == full[: len(cut)]
    roomy = sampled_rows(colocated(tmp_path / "roomy", vllm_max_model_length=prompt_tokens + 50))
    assert [completion for _, completion, _ in roomy] == [completion for _, completion, _ in uncapped]
    tight = colocated(tmp_path / "tight", vllm_max_model_length=prompt_tokens)
    with pytest.raises(ValueError, match=f"leaves no room .*vllm_max_model_length of {prompt_tokens} tokens"):
        tight.train()
    tight.close()
    closed = []
    monkeypatch.setattr(
        ColocatedEngine, "close", lambda engine, close=ColocatedEngine.close: closed.append(close(engine))
    )
    for wrong in (2049, 0, 30.0):  # past the model's context of 2048 (vLLM refuses to build such an LLM), not a length
        with pytest.raises(ValueError, match=f"vllm_max_model_length must be an integer from 2 to .* got {wrong!r}"):
            colocated(tmp_path / "wrong", vllm_max_model_length=wrong)
    assert len(closed) == 3  # the engine built for each refused trainer was closed, its KV cache freed


@pytest.fixture(scope="module")
def short_context_worker(tmp_path_factory):
    """A worker serving the tiny model saved with a context of CONTEXT tokens."""
    folder = tmp_path_factory.mktemp("short_context")
    short_context_model().save_pretrained(folder)
    TOKENIZER.save_pretrained(folder)
    worker = Worker("--model", str(folder), "--num-blocks", "512")
    yield worker
    worker.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_completions_run_to_the_models_context_as_on_trls_vllm_path(tmp_path, short_context_worker, mode):
    """Colocated, max_completion_length=None runs to the model's context; served, a max_completion_length past the
    workers' context ends there (finish reason "length"), as vLLM's max_model_len (the model's context by default)
    ends them. (Two rows each: the long completions are the cost.)"""
    prompt_tokens = len(TOKENIZER(dataset()["prompt"][0])["input_ids"])
    assert CONTEXT - prompt_tokens > 256  # (what a completion without a length got before)
    two_rows = dict(per_device_train_batch_size=2, num_generations=2)
    if mode == "colocate":
        ran = sampled_rows(colocated(tmp_path, short_context_model(), max_completion_length=None, **two_rows))
    else:
        address = short_context_worker.address
        ran = sampled_rows(served(tmp_path, address, max_completion_length=CONTEXT + 10, **two_rows))
    assert {len(prompt) + len(completion) for prompt, completion, _ in ran} == {CONTEXT}
    assert [reason for _, _, reason in ran] == ["length"] * 2


@pytest.mark.timeout(120)
def test_vllm_max_model_length_with_tools_is_refused_in_colocate_mode(tmp_path):
    """TRL's tool loop drops a turn past the model's context (its colocated vLLM's max_model_len only with
    vllm_mode="colocate", which this trainer is not): refused, not half honoured."""

    model, tokenizer = agent(calls=[{"name": "multiply_tool", "arguments": {"a": 3}}])
    with pytest.raises(ValueError, match="vllm_max_model_length with tools or environment_factory"):
        RolloutGRPOTrainer(
            model=model,
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, vllm_max_model_length=64),
            train_dataset=conversations(),
            processing_class=tokenizer,
            tools=[multiply_tool],
            rollout_mode="colocate",
        )


def test_top_k_minus_one_is_no_top_k_as_trl_passes_it_to_vllm(tmp_path):
    """TRL hands GRPOConfig.top_k to vLLM as is, where -1 turns top-k off: the same completions as top_k=0."""
    off = sampled_rows(colocated(tmp_path / "zero", top_k=0))
    assert sampled_rows(colocated(tmp_path / "minus_one", top_k=-1)) == off


def test_vespo_needs_a_token_level_importance_sampling_mode_as_on_trls_vllm_path(tmp_path):
    """TRL raises this on its vLLM path (GRPOTrainer's init, when use_vllm=True): the same words, before any round.
    With a token-level mode, or without the correction, the trainer is built."""
    source = inspect.getsource(GRPOTrainer.__init__)
    assert 'self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction' in source
    assert "VESPO loss requires `vllm_importance_sampling_mode`" in source
    with pytest.raises(ValueError, match="VESPO loss requires `vllm_importance_sampling_mode`.*Got: sequence_mask"):
        colocated(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    for config in (
        dict(vllm_importance_sampling_mode="token_mask"),
        dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_correction=False),
    ):
        colocated(tmp_path, loss_type="vespo", **config).close()


def test_rollout_func_by_position_is_refused_beside_max_staleness(tmp_path):
    """GRPOTrainer takes rollout_func as its 14th argument: given there, max_staleness refuses it as by keyword."""

    def rollout_func(prompts, trainer):
        raise AssertionError("never called")

    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    given = dict(model=tiny_model(0), reward_funcs=id_reward, args=grpo_config(tmp_path), train_dataset=dataset())
    given.update(processing_class=TOKENIZER, rollout_func=rollout_func)
    positional = [given.get(name) for name in names[: names.index("rollout_func") + 1]]
    with pytest.raises(ValueError, match="max_staleness > 0 does not apply to rollout_func"):
        RolloutGRPOTrainer(*positional, rollout_workers=["tcp://127.0.0.1:1"], max_staleness=1)


@pytest.mark.timeout(120)
def test_min_tokens_past_the_context_ends_there_as_vllm_ends_it(tmp_path):
    """vLLM ends a completion at max_model_len ("length") before it looks at min_tokens: a generation_kwargs
    min_tokens beyond the room the cap leaves ends at the cap too, instead of failing the round."""
    prompt_tokens = len(TOKENIZER(dataset()["prompt"][0])["input_ids"])
    cap = prompt_tokens + 3  # room for 3 tokens, below min_tokens and max_completion_length (8)
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(
            tmp_path, max_steps=1, vllm_max_model_length=cap, generation_kwargs={**NO_EOS, "min_tokens": 5}
        ),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=ENGINE,
    )
    ran = sampled_rows(trainer)
    assert {len(prompt) + len(completion) for prompt, completion, _ in ran} == {cap}
    assert {reason for _, _, reason in ran} == {"length"}


def test_an_engine_context_below_the_models_with_tools_is_refused_in_colocate_mode(tmp_path):
    """TRL's tool loop drops a turn past the model's context: an engine capped below it by rollout_engine_config
    (max_model_len) would fail the round mid-training, naming "the model's context" for the cap. Refused by name, as
    vllm_max_model_length is; without tools the cap is named as what set it."""
    model, tokenizer = agent(calls=[{"name": "multiply_tool", "arguments": {"a": 3}}])
    small = ContinuousBatchingConfig(num_blocks=64, block_size=16, max_model_len=512)
    with pytest.raises(ValueError, match="rollout_engine_config.max_model_len=512 below the model's context"):
        RolloutGRPOTrainer(
            model=model,
            reward_funcs=id_reward,
            args=grpo_config(tmp_path),
            train_dataset=conversations(),
            processing_class=tokenizer,
            tools=[multiply_tool],
            rollout_mode="colocate",
            rollout_engine_config=small,
        )
    trainer = colocated_with(tmp_path, small)
    assert trainer.rollout.context == (512, "rollout_engine_config.max_model_len")
    trainer.close()


def test_an_engine_context_above_the_models_is_refused_in_colocate_mode(tmp_path):
    """vLLM refuses a max_model_len above the model's context, and so does rollout-worker's --max-model-len; the
    colocated engine took rollout_engine_config.max_model_len=2049 on the tiny model (2048) and ran completions past
    the positions the model has (a GPT-2's learned positions fail there with an IndexError)."""
    above = ContinuousBatchingConfig(num_blocks=64, block_size=16, max_model_len=2049)
    with pytest.raises(
        ValueError, match="rollout_engine_config.max_model_len=2049 is above the model's context of 2048"
    ):
        colocated_with(tmp_path, above)
    colocated_with(tmp_path, ContinuousBatchingConfig(num_blocks=64, block_size=16, max_model_len=2048)).close()


def colocated_with(tmp_path, engine_config) -> RolloutGRPOTrainer:
    """A colocated trainer of the tiny model on the plain dataset, its engine built with `engine_config`."""
    return RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=engine_config,
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "config",
    [
        dict(top_k=20, top_p=0.9, generation_kwargs={"do_sample": False}),  # the guide's greedy setting
        dict(temperature=0.7, min_p=0.1, generation_kwargs={"do_sample": False}),
        dict(top_p=0.9, generation_kwargs={"temperature": 0}),  # vLLM's greedy spelling: it resets top_p/top_k/min_p
    ],
)
def test_greedy_rollouts_take_the_grpo_configs_sampling_settings(tmp_path, config):
    """Greedy rollouts beside a GRPOConfig's top_k / top_p / min_p / temperature sample transformers' greedy tokens
    (the round was refused by the engine: "has no effect while do_sample is False"), with log-probs at
    GRPOConfig.temperature, what TRL's loss recomputes (importance ratio 1)."""
    from test_trl import hf_greedy

    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, max_steps=1, **config),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=ENGINE,
    )
    ran = sampled_rows(trainer)
    prompts = [prompt for prompt, _, _ in ran]
    assert [completion for _, completion, _ in ran] == hf_greedy(tiny_model(0), prompts)
    (logs,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)


def test_warping_keys_beside_a_greedy_setting_are_refused_when_built(tmp_path):
    with pytest.raises(ValueError, match=r"generation_kwargs \['top_k'\] have no effect with greedy rollouts"):
        RolloutGRPOTrainer(
            model=tiny_model(0),
            reward_funcs=id_reward,
            args=grpo_config(tmp_path, generation_kwargs={"do_sample": False, "top_k": 5}),
            train_dataset=dataset(),
            processing_class=TOKENIZER,
            rollout_mode="colocate",
            rollout_engine_config=ENGINE,
        )


def test_top_k_minus_one_in_generation_kwargs_is_no_top_k_as_vllm_reads_it(tmp_path):
    """TRL's vLLM path updates its SamplingParams with generation_kwargs, where top_k=-1 is no top-k (it was refused:
    "top_k: must be an integer >= 0"): the same completions as without it."""
    off = sampled_rows(colocated(tmp_path / "zero"))
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path / "minus_one", max_steps=1, generation_kwargs={**NO_EOS, "top_k": -1}),
        train_dataset=dataset(),
        processing_class=TOKENIZER,
        rollout_mode="colocate",
        rollout_engine_config=ENGINE,
    )
    assert sampled_rows(trainer) == off

"""Colocated mode's arguments refused by their own names, pointing at the colocated API: stop strings without a
tokenizer, a round_context that is not callable, a peft_merge that is not a bool (`ColocatedEngine`), and a
sleep_between_rounds that is not a bool (`RolloutGRPOTrainer(rollout_mode="colocate")`).

References: transformers' model state (attention implementation, hooks) after a refused construction, and the
tokenizer's own decoding of what a stop string cut."""

from __future__ import annotations

import pytest

from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.presets import tiny_model, tiny_tokenizer
from test_trl import TOKENIZER
from trainer_bridge import ColocatedEngine, PromptGroup
from trainer_bridge.trl import RolloutGRPOTrainer
from trl_helpers import dataset, grpo_config, id_reward

CONFIG = ContinuousBatchingConfig(num_blocks=64, block_size=16)


def test_stop_strings_without_a_tokenizer_name_the_colocated_engines_argument():
    """The refusal names `groups[i].sampling.stop` and says to give ColocatedEngine a tokenizer (not another API's
    arguments); given one, the same group is sampled and cut at the stop string."""
    model = tiny_model(0)
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, stop_token_ids=())
    with ColocatedEngine(model, CONFIG) as engine:
        plain = engine.generate([PromptGroup([5, 9, 14], 1, greedy)])[0].completions[0].token_ids
        with pytest.raises(FieldError, match=r"groups\[0\]\.sampling\.stop: .*ColocatedEngine\(\.\.\., tokenizer="):
            engine.generate([PromptGroup([5, 9, 14], 1, {"do_sample": False, "stop": ["x"]})])
        assert engine.engine.open_group_ids() == []
    tokenizer = tiny_tokenizer()
    text = tokenizer.decode(plain[2:4])  # a stop string that greedy decoding reaches at its third token
    stopping = SamplingParams(do_sample=False, max_new_tokens=12, stop_token_ids=(), stop=[text])
    with ColocatedEngine(model, CONFIG, tokenizer=tokenizer) as engine:
        completion = engine.generate([PromptGroup([5, 9, 14], 1, stopping)])[0].completions[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids == plain[: len(completion.token_ids)] and len(completion.token_ids) <= 4


def test_bad_round_context_and_peft_merge_fail_at_construction_and_leave_the_model_alone():
    """Not at the first round, after the trainer set up: at construction, by name, with the model as it was."""
    model = tiny_model(0)
    model.config._attn_implementation = "eager"
    for kwargs, field in (
        (dict(round_context=5), "round_context"),
        (dict(round_context="unwrap"), "round_context"),
        (dict(peft_merge="no"), "peft_merge"),
        (dict(peft_merge=1), "peft_merge"),
    ):
        with pytest.raises(FieldError, match=f"^{field}: "):
            ColocatedEngine(model, CONFIG, **kwargs)
        assert model.config._attn_implementation == "eager"
        assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


@pytest.mark.timeout(120)
def test_trainer_refuses_a_sleep_between_rounds_that_is_not_a_bool(tmp_path):
    """ "false" would be truthy (the cache freed after every round): refused by name."""
    for value in ("false", 0):
        with pytest.raises(ValueError, match="sleep_between_rounds must be None or a bool"):
            RolloutGRPOTrainer(
                model=tiny_model(0),
                reward_funcs=id_reward,
                args=grpo_config(tmp_path),
                train_dataset=dataset(),
                processing_class=TOKENIZER,
                rollout_mode="colocate",
                sleep_between_rounds=value,
            )

"""Adapters with modules_to_save, the output head included, pushed adapter-only to a real rollout-worker subprocess
and served as peft computes them; PEFT settings workers cannot serve unmerged pushed merged by themselves (one
warning) unless adapter-only is insisted on; and a port of TRL's `test_train_vllm_and_peft` (GRPOTrainer with a
`LoraConfig(target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"])`) on `RolloutGRPOTrainer`."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora_push import GREEDY, PROMPT, lora_model, peft_greedy

from rollout.presets import tiny_model, tiny_tokenizer
from service_helpers import Worker
from trainer_bridge import PromptGroup, RolloutClient, push_weights

pytestmark = pytest.mark.timeout(240)
FALLBACK = "cannot be served adapter-only"
SAVED = ["embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def worker():
    server = Worker("--max-loras", "2", "--max-lora-rank", "8")
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(worker):
    with RolloutClient(worker.address, timeout=60) as connection:
        yield connection


@torch.inference_mode()
def peft_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """fp32 log-probs of `tokens` after PROMPT under the model as it is (its adapter set, or disabled)."""
    logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_a_pushed_head_norm_and_embeddings_serve_a_mixed_batch_like_peft(client):
    """Only the adapter travels (LoRA + the embeddings', the final norm's and the head's copies); the base's and the
    adapter's groups, sent together, each equal peft's generate and log-probs."""
    model = lora_model(11, target_modules=["q_proj", "v_proj"], modules_to_save=[*SAVED, "model.norm"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save.default" in name:  # a norm's weight starts all ones: std 0
                parameter.add_(torch.randn_like(parameter) * (parameter.std() if parameter.dim() > 1 else 1) * 0.5)
    push_weights(client, model)
    result = push_weights(client, model)
    assert not result.base_included
    trained = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if t.requires_grad)
    assert result.num_bytes == trained  # the LoRA pairs and both copies, nothing of the base
    groups = [PromptGroup(PROMPT, sampling=GREEDY, adapter=name, group_id=name) for name in ("__base__", "default")]
    results = {result.group_id: result.completions[0] for result in client.generate_many(groups)}
    with model.disable_adapter():
        assert results["__base__"].token_ids == peft_greedy(model, PROMPT)
        base = peft_logprobs(model, results["__base__"].token_ids)
    adapter = peft_logprobs(model, results["default"].token_ids)
    assert results["default"].token_ids == peft_greedy(model, PROMPT) != results["__base__"].token_ids
    for completion, reference in ((results["__base__"], base), (results["default"], adapter)):
        assert torch.allclose(torch.tensor(completion.logprobs), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (dict(use_dora=True), "use_dora: DoRA"),
        (dict(modules_to_save=["q_norm"]), "q_norm: modules_to_save of a Qwen3RMSNorm is not served unmerged"),
        # peft keeps an embedding's LoRA as lora_embedding_A/B: it was left out of adapter-only pushes, silently
        (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens: LoRA on a Embedding is not served unmerged"),
        # the prompt's first tokens (PROMPT[:2]) trained: refused in every mode before ("only LoRA can be merged")
        (dict(trainable_token_indices=[5, 42]), "trainable_token_indices: trainable tokens is not served unmerged"),
    ],
    ids=["dora", "saved-q-norm", "lora-on-embeddings", "trainable-tokens"],
)
def test_unservable_adapters_push_merged_once_warned_unless_adapter_only_is_asked(client, settings, why):
    """DoRA, or a saved module workers cannot serve unmerged (a norm per attention head): "auto" pushes the merged
    weights (peft's own merge, the saved copy in the module's place) with one warning over two pushes naming why, and
    the client then samples the base, equal to peft's generate; adapters="adapter" refuses it by the same name."""
    torch.manual_seed(12)
    model = get_peft_model(tiny_model(0), LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **settings}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name or "trainable_tokens" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.eval()
    with pytest.raises(ValueError, match=why):
        push_weights(client, model, adapters="adapter")
    with pytest.raises(ValueError, match=why):  # a named adapter is adapter-only: never merged into the base
        push_weights(client, model, adapter_name="named")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            result = push_weights(client, model)
    (fallback,) = [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert why in fallback
    assert not result.base_included and client.adapter is None
    completion = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0]
    assert completion.adapter is None and completion.token_ids == peft_greedy(model, PROMPT)


def test_an_adapter_name_with_weights_that_are_no_adapter_is_refused_before_anything_is_sent(client):
    """`adapter_name` with a plain model, or with adapters="merged", would have replaced the base model for every
    group (the name silently dropped): refused naming adapter_name, and the worker serves what it served."""
    before = client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0].token_ids
    lora = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for source, adapters in ((tiny_model(seed=5), "auto"), (lora, "merged")):
        with pytest.raises(ValueError, match="adapter_name.*would replace the base model"):
            push_weights(client, source, adapters=adapters, adapter_name="named")
    assert client.generate(PromptGroup(PROMPT, sampling=GREEDY)).completions[0].token_ids == before


def trl_trainer(tmp_path, client, peft_config: LoraConfig):
    from trainer_bridge.trl import RolloutGRPOTrainer
    from trl_helpers import dataset, grpo_config, id_reward

    return RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, learning_rate=0.1, max_steps=2),  # TRL's lr: tiny gradients must move the params
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        rollout_workers=client,
        peft_config=peft_config,
    )


def assert_ratio_is_one(trainer) -> None:
    """TRL's own importance ratio (its recomputed log-probs over the worker's) is 1 at both steps."""
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert abs(entry["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, entry


def test_trl_train_with_peft_saving_the_embeddings_and_the_head(tmp_path, client):
    """TRL's test_train_vllm_and_peft on our bridge: the peft params changed, the base params did not; every sync
    was adapter-only (no fallback warning, the worker serves the adapter at the trainer's version), and the worker's
    log-probs are TRL's own (importance ratio 1)."""
    base_names = [f"base_model.model.{n}" for n, _ in tiny_model(0).named_parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trl_trainer(tmp_path, client, LoraConfig(target_modules="all-linear", modules_to_save=SAVED))
        before = {n: p.clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    assert not [w for w in caught if FALLBACK in str(w.message)]
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, parameter in before.items():
        new = trainer.model.get_parameter(name)
        if name in base_names:
            torch.testing.assert_close(parameter, new, msg=f"Parameter {name} has changed.")
        elif "base_layer" not in name and "original_module" not in name:
            assert not torch.equal(parameter, new), f"Parameter {name} has not changed."
    assert {"base_model.model.lm_head.modules_to_save.default.weight"} <= set(before)
    assert_ratio_is_one(trainer)
    (stats,) = client.stats()
    assert stats["adapters"]["default"]["version"] == stats["policy_version"]


def test_trl_falls_back_to_merged_pushes_once_warned(tmp_path, client):
    """A DoRA LoraConfig: the trainer pushes merged weights at each sync with one warning in all, samples the base it
    pushed (no adapter), and TRL's importance ratio is 1 (the merge is peft's)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trl_trainer(tmp_path, client, LoraConfig(target_modules=["q_proj", "v_proj"], use_dora=True))
        trainer.train()
    assert len([w for w in caught if FALLBACK in str(w.message)]) == 1
    assert trainer.rollout_client.adapter is None
    assert_ratio_is_one(trainer)


@pytest.mark.parametrize("tying", [False, True], ids=["two-copies", "ensure_weight_tying"])
def test_saved_copies_of_tied_embeddings_are_pushed_adapter_only_and_served_like_peft(tmp_path, tying):
    """A tied model (most small checkpoints: Qwen2.5-0.5B, Qwen3-0.6B) with modules_to_save=["embed_tokens",
    "lm_head"]: peft trains copies apart from the frozen tied weight, so the adapter-only push serves them beside the
    tied base. It was refused in every push mode; after each of two pushes the worker's log-probs are peft's."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rollout.presets import TINY_MODEL_CONFIG, random_model

    random_model(Qwen3Config(**{**TINY_MODEL_CONFIG, "tie_word_embeddings": True}), 0, torch.float32).save_pretrained(
        tmp_path / "tied"
    )
    server = Worker("--model", str(tmp_path / "tied"), "--tokenizer", "none")
    lora = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=SAVED, ensure_weight_tying=tying)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "tied"), lora).eval()
    sequence = [*PROMPT, 17, 33, 2, 99]
    try:
        with RolloutClient(server.address, timeout=60) as connection:
            for push in range(2):
                with torch.no_grad():  # a training step: the copies and the LoRA pair move
                    for parameter in model.parameters():
                        if parameter.requires_grad:
                            parameter.add_(torch.randn_like(parameter) * 0.05)
                result = push_weights(connection, model, adapters="adapter")
                assert result.base_included == (push == 0) and connection.adapter == "default"
                scoring = PromptGroup(sequence, sampling={"max_new_tokens": 0, "prompt_logprobs": 0})
                served = torch.tensor(connection.generate(scoring).completions[0].prompt_logprobs)
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([sequence])).logits[0, :-1].float()
                reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:]).unsqueeze(1))
                assert torch.allclose(served, reference.squeeze(1), atol=1e-5, rtol=0)
    finally:
        server.close()

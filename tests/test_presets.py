"""The built-in preset: a deterministic tiny model and a tokenizer built in code, consistent with each other."""

from __future__ import annotations

import torch

from rollout.service.presets import tiny_model, tiny_tokenizer


def test_tokenizer_round_trips_text_within_the_models_vocabulary():
    tokenizer = tiny_tokenizer()
    model = tiny_model()
    text = "Q: 12+30=? A: 42.\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id != tokenizer.unk_token_id


def test_preset_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first, second = tiny_model(), tiny_model()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))

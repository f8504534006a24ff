"""Models the batch-invariant mode cannot make bit for bit are refused by name, in the engine
(`ContinuousBatchingConfig(batch_invariant=True)`) and in the trainer (`batch_invariant(model)`) alike, and a model
whose attention transformers' AttentionInterface does not serve is refused by the engine in any mode (its steps all
failed before). References: the mismatch each refusal stands for, shown on transformers' own forward where it is
the model's, not ours."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from conftest import make_engine
from rollout import FieldError
from trainer_bridge import batch_invariant

SMALL = dict(vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEAD_DIM = 16


def phi3_longrope() -> torch.nn.Module:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * (HEAD_DIM // 2),
        "long_factor": [4.0] * (HEAD_DIM // 2),
        "original_max_position_embeddings": 32,
    }
    config = transformers.Phi3Config(
        **SMALL, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, original_max_position_embeddings=32, rope_parameters=rope,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=4)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def deepseek_v3() -> torch.nn.Module:
    config = transformers.DeepseekV3Config(
        **SMALL, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def test_longrope_makes_a_tokens_logits_depend_on_the_rest_of_the_call():
    """Why LongRoPE is refused: transformers' own forward of a short sequence changes when a longer one (past
    original_max_position_embeddings) shares the call."""
    model = phi3_longrope()
    short = torch.arange(10, 20)[None]
    alone = model(short).logits[0]
    beside = model(torch.stack([torch.cat([short[0], torch.zeros(30, dtype=torch.long)]), torch.arange(40)])).logits
    assert float((beside[0, :10] - alone).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (phi3_longrope, "LongRoPE"),
        (gpt2, "Conv1D layers .*first: transformer.h.0.attn.c_attn"),
        (deepseek_v3, "multi-head latent attention"),
    ],
    ids=["longrope", "conv1d", "mla"],
)
def test_models_the_mode_cannot_make_bit_for_bit_are_refused_by_name(build, reason):
    model = build()
    with pytest.raises(FieldError, match=f"batch_invariant: .*{reason}"):
        with batch_invariant(model):
            pass
    assert model.config._attn_implementation != "rollout_invariant"  # refused before anything was switched
    if build is not deepseek_v3:  # (the paged cache refuses MLA in any mode, by name too)
        with pytest.raises(FieldError, match=f"batch_invariant: .*{reason}"):
            make_engine(model, batch_invariant=True)


def test_longrope_is_served_outside_the_mode_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rollout.engine.runner.model_checks"):
        engine = make_engine(phi3_longrope())
    engine.close()
    assert "LongRoPE" in caplog.text and "batch_invariant refuses" in caplog.text


@pytest.mark.parametrize(
    "build",
    [
        lambda: transformers.GPTNeoForCausalLM(
            transformers.GPTNeoConfig(
                vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]]
            )
        ),
        lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=256, hidden_size=32, n_layer=1)),
    ],
    ids=["gpt_neo", "bloom"],
)
def test_a_model_whose_attention_is_its_own_is_refused_by_the_engine(build):
    model = build().eval()
    before = model.config._attn_implementation
    model.set_attn_implementation("rollout_paged")  # what the engine would do: transformers keeps the model's own
    assert model.config._attn_implementation == before
    with pytest.raises(FieldError, match="attention does not go through transformers' AttentionInterface"):
        make_engine(model)
    assert model.config._attn_implementation == before

"""Model kinds whose arithmetic reaches past `nn.Linear` and the activation modules, each bit for bit between the
engine's log-probs (`ContinuousBatchingConfig(batch_invariant=True)`) and the trainer's own forward under
`trainer_bridge.batch_invariant` (the transformers model class, TRL's padded layout), on models scaled to realistic
entropy: eager experts that multiply with `@` (Aria, Ergo), a softplus gate (Laguna), a model that numbers positions
itself before its decoder (Fuyu), a Mish MLP, and modules behind accelerate's hooks. Each differed before (fp32 1.5e-7
to 4.5e-6, Fuyu 0.10 in bf16). What the mode cannot compute (ALiBi, per-layer attention shapes, a compiled model) is
refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from test_batch_invariant import BATCHES, PAIRS, largest_gap, realistic
from test_batch_invariant_engine import SMALL, largest_gap_to_trainer, sample_groups

from conftest import VOCAB, make_engine, make_prompts
from rollout import FieldError
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.invariant.swaps import mode_need_of
from trainer_bridge import batch_invariant

SIZES = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "aria": lambda: transformers.AriaTextConfig(
        **SIZES, **ATTENTION, intermediate_size=128, num_hidden_layers=1, moe_num_experts=4, moe_topk=2,
        moe_num_shared_experts=1,
    ),
    "ergo": lambda: transformers.ErgoConfig(
        **SIZES, **ATTENTION, num_hidden_layers=2, first_dense_intermediate_size=128, num_dense_blocks=1,
        moe_intermediate_size=32, shared_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    ),
    "laguna": lambda: transformers.LagunaConfig(
        **SIZES, **ATTENTION, intermediate_size=128, num_hidden_layers=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16,
    ),
    "mish": lambda: transformers.LlamaConfig(
        **SIZES, hidden_size=128, intermediate_size=300, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, hidden_act="mish",
    ),
    "fuyu": lambda: transformers.FuyuConfig(
        text_config=dict(
            model_type="persimmon", **SIZES, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4,
        )
    ),
}  # fmt: skip


def realistic_kind(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny seeded model of `kind`, scaled to about 1.5 nats of entropy, in `dtype`."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():
        scale_to_entropy(model, [prompt + completion for prompt, completion in PAIRS[:3]])
    return model.to(dtype)


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("aria", torch.float32),
        ("ergo", torch.float32),
        ("laguna", torch.float32),
        ("mish", torch.float32),
        ("fuyu", torch.bfloat16),
    ],
    ids=["aria-experts-matmul", "ergo-experts-matmul", "laguna-softplus-gate", "llama-mish-mlp", "fuyu-own-positions"],
)
def test_the_engines_logprobs_are_the_trainers_forward(kind, dtype):
    model = realistic_kind(kind, dtype)
    trainer = copy.deepcopy(model)
    engine = make_engine(model, batch_invariant=True, **SMALL)
    samples = sample_groups(engine, make_prompts(4, 2, 20, seed=1), "a")
    assert largest_gap_to_trainer(trainer, samples) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_modules_behind_accelerates_hooks_are_swapped(dtype):
    """A model dispatched by accelerate (`device_map`, offloading) has a hook's `forward` on each module with
    weights: the swap goes behind it, so a row's log-probs are those it has alone and no per-call mode is needed;
    leaving the block gives the hooks back."""
    from accelerate.hooks import attach_align_device_hook

    model = realistic("gemma2", dtype)  # tanh-GELU, whose torch kernel rounds by position
    attach_align_device_hook(model, execution_device=torch.device("cpu"))
    hooked = {
        name: module.__dict__["_old_forward"] for name, module in model.named_modules() if "_hf_hook" in vars(module)
    }
    assert hooked
    with batch_invariant(model):
        assert largest_gap(model, BATCHES) == 0.0
    assert mode_need_of(model).needed(model) is False
    assert {name: module.__dict__["_old_forward"] for name, module in model.named_modules() if name in hooked} == hooked


def test_alibi_per_layer_shapes_and_a_compiled_model_are_refused_by_name():
    """Refused when the block is entered, before the first forward (the engine serves none of them in any mode)."""
    falcon = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, alibi=True
    )
    model = transformers.AutoModelForCausalLM.from_config(falcon).eval()
    with pytest.raises(FieldError, match=r"batch_invariant: ALiBi \(config.alibi"):
        with batch_invariant(model):
            pass
    per_layer = transformers.AutoConfig.for_model(
        "gemma4_text", **SIZES, **ATTENTION, intermediate_size=128, num_hidden_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    )  # fmt: skip
    gemma4 = transformers.AutoModelForCausalLM.from_config(per_layer).eval()
    with pytest.raises(FieldError, match="batch_invariant: Gemma4ForCausalLM's config gives no one attention shape"):
        with batch_invariant(gemma4):
            pass
    plain = realistic("qwen3", torch.float32)
    with pytest.raises(FieldError, match="batch_invariant: the model is torch.compile'd"):
        with batch_invariant(torch.compile(plain)):
            pass
    plain.model.layers[0].mlp.compile()  # compiled in place
    with pytest.raises(FieldError, match="batch_invariant: module 'model.layers.0.mlp' is torch.compile'd"):
        with batch_invariant(plain):
            pass

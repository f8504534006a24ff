"""Models whose attention the paged cache cannot serve, refused when the engine is built (one probe forward) instead of
accepted and then failing every request at its first step, as a model sweep found them on transformers 5.25:
StableLM, Nemotron and Falcon call their attention function without their forward's keyword arguments; JetMoE's
attention gives keys of more heads than the config's `num_key_value_heads`. A model the probe passes is served as
transformers' `generate` decodes it, and the probe leaves the model as it was (attention implementation, training
mode, no gradient)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BertConfig,
    DiffLlamaConfig,
    ErgoConfig,
    FalconConfig,
    JetMoeConfig,
    MoshiConfig,
    PersimmonConfig,
    Qwen3Config,
    RobertaConfig,
    StableLmConfig,
    xLSTMConfig,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, apply_rotary_pos_emb, eager_attention_forward

from conftest import VOCAB, make_engine, make_prompts, run_to_completion
from rollout import SamplingParams, generate_batch
from rollout.config import FieldError

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def build(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "config, refusal",
    [
        (StableLmConfig(**SIZES, num_key_value_heads=2), "StableLmAttention calls its attention function without"),
        (
            FalconConfig(
                **{k: SIZES[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")},
                new_decoder_architecture=True,
                num_kv_heads=2,
            ),
            "FalconAttention calls its attention function without|transformers would not switch FalconForCausalLM",
        ),  # transformers before 5.25: Falcon's own attention
        (
            JetMoeConfig(**SIZES, num_key_value_heads=2),
            r"JetMoeAttention gives its attention 4 key heads of 128 .*2 of",
        ),
        (DiffLlamaConfig(**SIZES, num_key_value_heads=2), "DiffLlamaAttention calls its attention function 2 times"),
        (
            BartConfig(
                vocab_size=VOCAB,
                d_model=64,
                decoder_layers=2,
                encoder_layers=2,
                decoder_attention_heads=4,
                encoder_attention_heads=4,
                decoder_ffn_dim=128,
                encoder_ffn_dim=128,
                forced_eos_token_id=None,
            ),
            "BartAttention gives one token at one position different keys",
        ),  # its decoder numbers its tokens from the input's own length, ignoring position_ids
        (BertConfig(**SIZES, is_decoder=False), r"BertSelfAttention is not causal \(is_causal=False"),
        (
            MoshiConfig(**SIZES, num_key_value_heads=2, ffn_dim=128, sliding_window=8),
            r"MoshiAttention \(layer 0\) is a sliding-window layer \(config sliding_window=8\) but does not pass",
        ),  # its window is only in transformers' cache and mask
        (RobertaConfig(**SIZES, is_decoder=True), r"RobertaForCausalLM numbers its positions from padding_idx \+ 1"),
        (xLSTMConfig(vocab_size=VOCAB, hidden_size=64, num_blocks=2, num_heads=4), "config gives no attention shape"),
    ],
    ids=["stablelm", "falcon", "jetmoe", "diffllama", "bart", "bert-bidirectional", "moshi", "roberta", "xlstm"],
)
def test_an_attention_the_paged_cache_cannot_serve_is_refused_when_the_engine_is_built(config, refusal):
    model = build(config).train()
    model.get_input_embeddings().eval()  # a part the trainer keeps in eval mode (frozen embeddings)
    flags = [module.training for module in model.modules()]
    implementation = model.config._attn_implementation
    with pytest.raises(FieldError, match=refusal) as refused:
        make_engine(model)
    assert refused.value.field == "model"
    assert model.config._attn_implementation == implementation  # left as it was
    assert [module.training for module in model.modules()] == flags
    assert all(parameter.grad is None for parameter in model.parameters())


def test_a_model_the_probe_passes_decodes_as_generate():
    """Persimmon (no grouped-query attention: its config has no num_key_value_heads) is served, token for token."""
    assert_decodes_as_generate(build(PersimmonConfig(**SIZES)).eval())


def assert_decodes_as_generate(model: torch.nn.Module) -> None:
    """Three greedy requests through an engine give `model.generate`'s tokens."""
    prompts = make_prompts(3, 4, 10, seed=2)
    engine = make_engine(model)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(do_sample=False, stop_token_ids=[]), max_new_tokens=6)
    outputs = run_to_completion(engine)
    engine.close()
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert outputs[f"r{index}"].generated_tokens == expected.tolist()


def test_a_model_an_engine_holds_is_not_probed_again(monkeypatch):
    """A second engine on a model the first one is serving must not switch its attention (the probe would, for one
    forward, under the first engine's running steps): the model passed the probe when the first engine was built."""
    model = build(PersimmonConfig(**SIZES)).eval()
    first = make_engine(model)
    switches = []
    original = type(model).set_attn_implementation
    monkeypatch.setattr(
        type(model), "set_attn_implementation", lambda self, name: switches.append(name) or original(self, name)
    )
    second = make_engine(model)
    assert switches == [] and model.config._attn_implementation == "rollout_paged"
    second.close()
    first.close()
    monkeypatch.undo()
    assert model.config._attn_implementation != "rollout_paged"


def test_a_forward_that_fails_is_refused_when_the_engine_is_built_with_its_error():
    model = build(PersimmonConfig(**SIZES))

    def broken(*args, **kwargs):
        raise NotImplementedError("this forward is not served")

    model.model.forward = broken
    with pytest.raises(FieldError, match="PersimmonForCausalLM's forward failed .*NotImplementedError: this forward"):
        make_engine(model)
    assert model.config._attn_implementation != "rollout_probe"


def test_a_model_on_the_meta_device_is_refused_as_not_loaded_and_strings_as_not_tokenized():
    """A model built on the meta device (no weights yet) and text given for token ids: each refused saying what to do
    (the forward's own error spoke of Tensor.item(); the prompt's of a str only)."""
    with torch.device("meta"):
        model = build(PersimmonConfig(**SIZES))
    with pytest.raises(FieldError, match="on the meta device, without values: load its weights first"):
        make_engine(model)
    with pytest.raises(FieldError, match=r"input_ids: .*got str: tokenize it first"):
        generate_batch(build(PersimmonConfig(**SIZES)), ["some text"], max_new_tokens=2, progress_bar=False)


def test_a_model_without_a_generation_config_is_probed_and_served():
    """A causal LM outside GenerationMixin (custom code) may have no generation_config: the probe's choice of token
    read it and failed ("vars() argument must have __dict__"), refusing the model as if its forward had failed."""
    model = build(PersimmonConfig(**SIZES))
    model.generation_config = None
    engine = make_engine(model)
    assert engine.runner.model is model
    engine.close()


def test_a_router_that_scores_through_a_linear_of_its_own_decodes_as_generate():
    """Ergo's router keeps its weight in a `linear` submodule (the engine's MoE route taps read `router.weight`)."""
    config = ErgoConfig(
        **SIZES,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_dense_intermediate_size=128,
        shared_intermediate_size=32,
    )
    assert_decodes_as_generate(build(config).eval())


class SelfComputingAttention(Qwen3Attention):
    """Qwen3's attention computing its scores itself (transformers' eager function called directly, not through
    the attention interface the engine switches): `generate` runs it right, the paged cache never sees it."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        output, weights = eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def attention_of(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].self_attn


@pytest.mark.parametrize(
    "change, refusal",
    [
        (
            lambda model: setattr(attention_of(model, 1), "__class__", SelfComputingAttention),
            r"Qwen3ForCausalLM's layers 1 \(of num_hidden_layers=2\) called no attention function",
        ),
        (
            lambda model: setattr(attention_of(model, 1), "layer_idx", 0),
            r"Qwen3Attention and Qwen3Attention are two attention modules with one layer_idx \(0\)",
        ),
        (
            lambda model: setattr(attention_of(model, 1), "layer_idx", None),
            r"Qwen3Attention has layer_idx=None, not one of the config's 2 layers",
        ),
        (
            lambda model: setattr(attention_of(model, 1), "layer_idx", 2),
            r"Qwen3Attention has layer_idx=2, not one of the config's 2 layers",
        ),
    ],
    ids=["computes-its-own-attention", "shared-layer-idx", "no-layer-idx", "layer-idx-out-of-range"],
)
def test_a_layer_the_paged_cache_would_not_see_or_would_overwrite_is_refused(change, refusal):
    """Each layer of the config calls the attention function once, through a module with its own layer_idx: a
    layer computing its attention itself was served with the step's tokens alone as its keys (wrong tokens), two
    modules with one layer_idx overwrote each other's keys, and a module without one failed every first step."""
    model = build(Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16))
    change(model)
    with pytest.raises(FieldError, match=refusal):
        make_engine(model)
    assert model.config._attn_implementation != "rollout_probe"


def test_a_model_cut_short_of_its_config_decodes_as_generate():
    """A model whose last layers were removed (pruned, or a self-draft's first layers) while its config still counts
    them: no module holds those indices, so they are unused cache layers, not layers the cache would miss."""
    model = build(Qwen3Config(**{**SIZES, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16)).eval()
    model.model.layers = model.model.layers[:2]
    assert model.config.num_hidden_layers == 4
    assert_decodes_as_generate(model)

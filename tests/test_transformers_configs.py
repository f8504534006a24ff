"""transformers' own `ContinuousBatchingConfig` accepted by rollout's doors (what TRL's transformers path passes):
converted field by field, refused by name where rollout cannot honour a value; outputs checked against transformers'
own `generate`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers import CompileConfig, GenerationConfig

from conftest import make_prompts, reference_copy, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch, init_continuous_batching
from rollout.config import FieldError
from rollout.engine.engine import Engine
from rollout.transformers_configs import (
    _ACCEPTED_VALUES,
    _CONVERTERS,
    _INFERRED_WHEN_NONE,
    _SAME_CONCEPT,
    engine_config,
    from_transformers,
    page_size_field,
)

TransformersConfig = transformers.ContinuousBatchingConfig


def test_every_transformers_field_has_a_decision():
    """A field of the installed transformers that this mapping does not name would only pass at its default; listing
    them all here makes a new transformers field a visible decision."""
    known = {"page_size", "block_size", *_SAME_CONCEPT, *_INFERRED_WHEN_NONE, *_CONVERTERS, *_ACCEPTED_VALUES}
    installed = {f.name for f in dataclasses.fields(TransformersConfig)}
    assert installed - known == set()
    # The only decisions for fields the installed release lacks: other releases' (page_size was block_size before
    # transformers 5.2x; auto_switch_to_flash is newer than 5.17).
    assert known - installed <= {"page_size", "block_size", "auto_switch_to_flash"}
    rollout_fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert set(_SAME_CONCEPT.values()) | set(_INFERRED_WHEN_NONE.values()) <= rollout_fields


def test_generate_batch_takes_transformers_config_and_matches_generate():
    """rollout.generate_batch(model, inputs, continuous_batching_config=transformers' config) runs, honours the
    fields (page size, cache, batch shape, logprobs) and decodes exactly as transformers' greedy generate."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompts = make_prompts(5, 3, 20, seed=4)
    config = TransformersConfig(**{page_size_field(): 8}, num_blocks=96, max_batch_tokens=40, max_requests_per_batch=3)
    config.return_logprobs = True
    with init_continuous_batching(model, continuous_batching_config=config) as manager:
        converted = manager.config
    assert (converted.block_size, converted.num_blocks, converted.max_batch_tokens, converted.max_num_seqs) == (
        8,
        96,
        40,
        3,
    )
    assert converted.return_logprobs and converted.overlap_scheduling is None
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    outputs = generate_batch(
        model, prompts, sampling=greedy, max_new_tokens=10, continuous_batching_config=config, progress_bar=False
    )
    for index, prompt in enumerate(prompts):
        expected = reference.generate(
            torch.tensor([prompt]), generation_config=GenerationConfig(do_sample=False, max_new_tokens=10)
        )[0, len(prompt) :].tolist()
        out = outputs[f"req_{index}"]
        assert out.generated_tokens == expected
        assert len(out.logprobs) == 10


def test_transformers_defaults_convert_to_their_own_values():
    """transformers' defaults are honoured as values (page_size 256, no logprobs), and its inferred fields (None)
    leave rollout's own defaults."""
    converted = engine_config(TransformersConfig())
    ours = ContinuousBatchingConfig()
    assert converted.block_size == 256 and converted.return_logprobs is False
    assert (converted.max_batch_tokens, converted.max_num_seqs) == (ours.max_batch_tokens, ours.max_num_seqs)
    assert converted.use_cuda_graph is None and converted.overlap_scheduling is None and converted.seed is None


def test_renamed_and_converted_fields():
    assert engine_config(TransformersConfig(block_size=32)).block_size == 32  # the pre-5.17 name
    assert engine_config(TransformersConfig(use_async_batching=False)).overlap_scheduling is False
    assert engine_config(TransformersConfig(use_cuda_graph=(False, True))).use_cuda_graph is True
    assert engine_config(TransformersConfig(use_cuda_graph=False)).use_cuda_graph is False
    compile_config = CompileConfig(mode="default")
    assert (
        engine_config(TransformersConfig(decode_compile_config=compile_config)).decode_compile_config is compile_config
    )
    assert engine_config(TransformersConfig(scheduler_type="prefill_first")).scheduler_type == "prefill_first"
    for name in ("per_request_processors", "drop_unsupported_processors", "disable_nccl_graph_mixing"):
        engine_config(TransformersConfig(**{name: not getattr(TransformersConfig(), name)}))  # both values accepted


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_cuda_graph", (True, True)),
        ("varlen_compile_config", CompileConfig()),
        ("q_padding_interval_size", 64),
        ("kv_padding_interval_size", 128),
        ("auto_switch_to_flash", False),
        ("max_blocks_per_request", 8),
        ("default_compile_level", 2),
        ("safety_margin", 0.1),
        ("cpu_offload_space_safety_threshold", 1.0),
        ("scheduler_type", "priority"),  # carried over, then refused by rollout's own validation
    ],
)
def test_values_rollout_cannot_honour_are_refused_by_name(field, value):
    if field not in {f.name for f in dataclasses.fields(TransformersConfig)}:
        pytest.skip(f"needs a newer transformers: {field} is not a field of transformers {transformers.__version__}")
    config = TransformersConfig()
    setattr(config, field, value)  # after __post_init__, which may reject or normalise some of these itself
    with pytest.raises(FieldError) as raised:
        Engine(tiny_model("qwen3"), config)
    assert raised.value.field == field


def test_an_unknown_field_passes_only_at_its_default():
    """A field of a newer transformers that rollout does not know: its default is accepted, anything else refused."""
    newer = dataclasses.make_dataclass("ContinuousBatchingConfig", [("new_knob", int, 0)], bases=(TransformersConfig,))
    assert from_transformers(newer()).block_size == 256
    with pytest.raises(FieldError, match="new_knob: 3 is not supported"):
        from_transformers(newer(new_knob=3))


def test_anything_else_is_refused():
    with pytest.raises(FieldError) as raised:
        generate_batch(tiny_model("qwen3"), [[1, 2]], continuous_batching_config={"num_blocks": 8})
    assert raised.value.field == "continuous_batching_config"


def test_config_seed_makes_unseeded_sampling_repeat():
    """ContinuousBatchingConfig.seed (transformers' `seed`): requests without their own seed draw the same seeds in
    a run with the same config seed, and others with another."""
    model = tiny_model("qwen3")
    prompts = make_prompts(3, 4, 12, seed=5)
    sampling = SamplingParams(temperature=1.5, stop_token_ids=())

    def run(config) -> list[list[int]]:
        outputs = generate_batch(
            model,
            prompts,
            sampling=sampling,
            max_new_tokens=12,
            n=2,
            continuous_batching_config=config,
            progress_bar=False,
        )
        return [output.generated_tokens for output in outputs.values()]

    ours = dict(num_blocks=64, block_size=4)
    first = run(ContinuousBatchingConfig(**ours, seed=7))
    assert run(ContinuousBatchingConfig(**ours, seed=7)) == first
    assert run(TransformersConfig(**{page_size_field(): 4}, num_blocks=64, seed=7)) == first
    assert run(ContinuousBatchingConfig(**ours, seed=8)) != first
    with pytest.raises(FieldError, match="seed"):
        ContinuousBatchingConfig(seed=1.5)

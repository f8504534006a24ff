"""Cases a differential fuzz of `batch_invariant` found: models the mode accepted but could not make bit for bit.

- Dynamic NTK RoPE (`rope_type: "dynamic"`): past max_position_embeddings transformers recomputes the rotary
  frequencies from the longest position of each forward (and keeps them), so transformers' own forward gives a short
  row other logits beside a long one. The engine refuses it with a max_model_len beyond that length, the trainer's
  block a forward that reaches past it; within it the engine's log-probs are the trainer's bit for bit.
- A model whose attention transformers will not switch (GPT-Neo, MPT, Bloom: transformers only warns and
  keeps their own attention): `batch_invariant(model)` refuses it by name, as the engine does, and leaves it as it
  was.
- GPT-OSS's attention sinks, which the invariant attention does not compute: refused when the block is entered (it
  was at the first forward); Doge's own float mask: the first forward's error names the attention class.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_batch_invariant import trl_batch_logprobs
from transformers import AutoModelForCausalLM, DogeConfig, GPTNeoConfig, GptOssConfig, LlamaConfig

from conftest import _COMMON, VOCAB, make_engine, make_prompts, run_to_completion
from rollout import FieldError, SamplingParams
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from trainer_bridge import batch_invariant

LENGTH = 48  # the dynamic rotary's max_position_embeddings


def dynamic_rope_model(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny Llama with dynamic NTK RoPE (factor 2 past LENGTH tokens), scaled to about 1.5 nats of entropy."""
    config = LlamaConfig(
        **{**_COMMON, "max_position_embeddings": LENGTH},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        scale_to_entropy(model, make_prompts(3, 20, 40, seed=1))
    return model.to(dtype)


@torch.no_grad()
def test_dynamic_rope_makes_a_rows_logits_depend_on_its_batch_past_its_length():
    """The reason for the refusals below, in transformers' own forward: a short row's log-probs change beside a row
    longer than max_position_embeddings, and not beside one within it."""
    model = dynamic_rope_model(torch.float32)
    short = (make_prompts(1, 8, 8, seed=2)[0], [1, 2, 3])
    alone = trl_batch_logprobs(model, [short])[0]
    within = trl_batch_logprobs(model, [short, (make_prompts(1, 40, 40, seed=3)[0], [4])])[0]
    past = trl_batch_logprobs(model, [short, (make_prompts(1, 60, 60, seed=3)[0], [4])])[0]
    assert float((within - alone).abs().max()) < 1e-5
    assert float((past - alone).abs().max()) > 1e-3


def test_dynamic_rope_past_its_length_is_refused_by_the_engine_and_the_trainers_block():
    model = dynamic_rope_model(torch.float32)
    with pytest.raises(FieldError, match=f"batch_invariant: dynamic NTK RoPE .* set max_model_len to at most {LENGTH}"):
        make_engine(copy.deepcopy(model), batch_invariant=True, max_model_len=LENGTH + 16)
    with torch.no_grad(), batch_invariant(model):
        with pytest.raises(FieldError, match="batch_invariant: dynamic NTK RoPE .* reaches position 59"):
            model(torch.tensor([make_prompts(1, 60, 60, seed=3)[0]]))
        model(torch.tensor([make_prompts(1, LENGTH, LENGTH, seed=3)[0]]))  # the longest it keeps its frequencies for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_rope_within_its_length_is_bit_for_bit(dtype):
    model = dynamic_rope_model(dtype)
    trainer = copy.deepcopy(model)
    engine = make_engine(model, batch_invariant=True, num_blocks=40, block_size=4, max_batch_tokens=12)
    for index, prompt in enumerate(make_prompts(3, 3, 12, seed=4) + make_prompts(1, 37, 37, seed=6)):
        sampling = SamplingParams(temperature=0.7, seed=index, logprob_mode="temperature_scaled")
        engine.add_request(f"g{index}", prompt, sampling, n=2, max_new_tokens=10)
    samples = [(list(o.prompt_ids), list(o.generated_tokens), o.logprobs) for o in run_to_completion(engine).values()]
    engine.close()
    assert max(len(prompt) + len(completion) for prompt, completion, _ in samples) > 40
    with torch.no_grad(), batch_invariant(trainer):  # TRL's layout, log_softmax(logits / T) in fp32
        prompt_width = max(len(prompt) for prompt, _, _ in samples)
        width = prompt_width + max(len(completion) for _, completion, _ in samples)
        rows, masks = [], []
        for prompt, completion, _ in samples:
            left, right = prompt_width - len(prompt), width - prompt_width - len(completion)
            rows.append([0] * left + prompt + completion + [0] * right)
            masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        logits = trainer(input_ids=torch.tensor(rows), attention_mask=torch.tensor(masks)).logits
    for row, (_, completion, ours) in enumerate(samples):
        scores = torch.log_softmax(logits[row, prompt_width - 1 : prompt_width - 1 + len(completion)].float() / 0.7, -1)
        assert torch.equal(torch.tensor(ours), scores.gather(1, torch.tensor(completion)[:, None])[:, 0])


def gpt_neo() -> torch.nn.Module:
    """A tiny GPT-Neo (its attention does not go through transformers' AttentionInterface; Falcon's does since
    transformers 5.25)."""
    config = GPTNeoConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global"], 2]],
        max_position_embeddings=128,
    )
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def test_a_model_whose_attention_transformers_will_not_switch_is_refused_by_the_trainers_block():
    model = gpt_neo()
    ids = torch.tensor([make_prompts(1, 12, 12, seed=5)[0]])
    before = model(ids).logits
    implementation = model.config._attn_implementation
    with pytest.raises(FieldError, match="batch_invariant: transformers would not switch GPTNeoForCausalLM's"):
        with batch_invariant(model):
            pass
    assert model.config._attn_implementation == implementation
    assert torch.equal(model(ids).logits, before)  # nothing left swapped or hooked
    with pytest.raises(FieldError, match="would not switch GPTNeoForCausalLM's attention"):
        make_engine(model, batch_invariant=True)  # as the engine refuses it


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def test_attention_sinks_are_refused_when_the_trainers_block_is_entered():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        GptOssConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    )
    implementation = model.config._attn_implementation
    with pytest.raises(FieldError, match=r"batch_invariant: attention sinks \(GPT-OSS's; first: model.layers.0"):
        with batch_invariant(model):
            raise AssertionError("the block was entered")
    assert model.config._attn_implementation == implementation


def test_a_float_mask_of_the_models_own_is_refused_naming_its_attention():
    """Doge adds its dynamic mask to the attention mask: not a mask the invariant attention computes bit for bit."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DogeConfig(**SMALL, num_key_value_heads=2))
    with batch_invariant(model), pytest.raises(ValueError, match="DogeAttention hands the batch-invariant attention"):
        model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long))

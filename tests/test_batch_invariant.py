"""`trainer_bridge.batch_invariant(model)`: the trainer's own forward (the transformers model class, a padded batch as
TRL lays it out: prompts left-padded, completions right-padded, `input_ids` and `attention_mask` only) gives each row
bit for bit the logits it gets alone, whatever else is in the batch and whatever the thread count, in fp32 and bf16,
on a model whose head is scaled to realistic entropy. Without the mode the same comparison differs (so the checks can
fail); gradients under the mode are those of the ordinary forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTJConfig, GPTNeoXConfig, LlamaConfig

from conftest import VOCAB, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.invariant.attention import invariant_attention_forward
from trainer_bridge import batch_invariant

DTYPES = [torch.float32, torch.bfloat16]
# (prompt, completion) pairs of different lengths, so that each batch pads every row on both sides differently.
PAIRS = [
    ([(7 * i + j) % VOCAB for j in range(p)], [(11 * i + 3 * j + 1) % VOCAB for j in range(c)])
    for i, (p, c) in enumerate([(7, 20), (19, 5), (3, 33), (40, 12), (11, 1), (26, 70)])
]


# Wider than conftest's models, one layer each: linears reduce over 512 and 768 (in fp32, slices of 256 added in
# order), head_dim 128 with one query head per key head (a decode's single query row padded to the matmuls' 16),
# head_dim 320 (scores reduced in slices too), and an MLP 300 wide (torch's SiLU rounds a row's last elements
# otherwise than the rest, depending on the tensor's size).
WIDE = {
    "llama_wide_mha": dict(hidden_size=512, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4),
    "llama_head320": dict(hidden_size=640, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1),
    "llama_mlp300": dict(hidden_size=128, intermediate_size=300, num_attention_heads=4, num_key_value_heads=2),
}
WIDE_HEAD_DIMS = {"llama_wide_mha": 128, "llama_head320": 320, "llama_mlp300": 32}
# Families whose causal LM passes `input_ids` to its decoder by position (Pythia's GPT-NeoX with partial rotary, GPT-J):
# positions must still be numbered from each row's first unmasked token.
POSITIONAL = {
    "gpt_neox": lambda: GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.25,
    ),
    "gptj": lambda: GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
}


def wide_model(kind: str) -> torch.nn.Module:
    """One of the `WIDE` Llama models, seeded."""
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=1, head_dim=WIDE_HEAD_DIMS[kind], **WIDE[kind])
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config).eval()


def realistic(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny model of `kind` (conftest's, or `WIDE`) whose mean next-token entropy is about 1.5 nats (random
    weights hide mismatch)."""
    if kind in POSITIONAL:
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(POSITIONAL[kind]()).eval()
    else:
        model = wide_model(kind) if kind in WIDE else tiny_model(kind, seed=1)
    scale_to_entropy(model, [prompt + completion for prompt, completion in PAIRS[:3]])
    return model.to(dtype)


def trl_batch_logprobs(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Each completion's token log-probs from one forward over the batch in TRL's layout (fp32 log_softmax)."""
    prompt_width = max(len(p) for p, _ in pairs)
    completion_width = max(len(c) for _, c in pairs)
    rows, masks = [], []
    for prompt, completion in pairs:
        left, right = prompt_width - len(prompt), completion_width - len(completion)
        rows.append([0] * left + prompt + completion + [0] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    logits = model(input_ids=torch.tensor(rows), attention_mask=torch.tensor(masks)).logits.float()
    out = []
    for row, (_, completion) in enumerate(pairs):
        positions = logits[row, prompt_width - 1 : prompt_width - 1 + len(completion)]
        out.append(torch.log_softmax(positions, -1).gather(1, torch.tensor(completion)[:, None])[:, 0])
    return out


def largest_gap(model: torch.nn.Module, batches: list[list[int]]) -> float:
    """The largest |delta| of any completion token's log-prob between a batch and that sequence alone."""
    alone = {i: trl_batch_logprobs(model, [PAIRS[i]])[0] for batch in batches for i in batch}
    gap = 0.0
    for batch in batches:
        for i, logprobs in zip(batch, trl_batch_logprobs(model, [PAIRS[i] for i in batch])):
            gap = max(gap, float((logprobs - alone[i]).abs().max()))
    return gap


BATCHES = [[0, 1, 2, 3, 4, 5], [5, 3, 1], [2, 0], [4, 5, 0, 1]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma2", "mistral_sliding", "qwen3_moe", *WIDE, *POSITIONAL])
@torch.no_grad()
def test_a_padded_batch_gives_each_row_the_logprobs_it_has_alone(kind, dtype):
    model = realistic(kind, dtype)
    with batch_invariant(model):
        assert largest_gap(model, BATCHES) == 0.0
    # The ordinary forward differs (so the check can fail): about 1e-5 in fp32, 0.05-0.15 nats in bf16.
    assert largest_gap(model, BATCHES) > (1e-3 if dtype == torch.bfloat16 else 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_the_thread_count_changes_no_bit(dtype):
    model = realistic("qwen3", dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with batch_invariant(model):
                results.append(trl_batch_logprobs(model, [PAIRS[i] for i in BATCHES[0]]))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_gradients_are_the_ordinary_forwards():
    """The loss's gradients under the mode match the ordinary forward's (fp32, to rounding)."""
    model = realistic("qwen3", torch.float32)
    pairs = [PAIRS[i] for i in BATCHES[1]]

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.cat(trl_batch_logprobs(model, pairs)).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    with batch_invariant(model):
        invariant = gradients()
    assert plain.keys() == invariant.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(invariant[name], plain[name], rtol=1e-3, atol=1e-4, msg=name)


@torch.no_grad()
def test_leaving_the_block_restores_the_model_also_after_an_error():
    model = realistic("qwen3", torch.bfloat16)
    before = trl_batch_logprobs(model, [PAIRS[i] for i in BATCHES[0]])
    with pytest.raises(RuntimeError, match="inside"), batch_invariant(model):
        assert model.config._attn_implementation == "rollout_invariant"
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    after = trl_batch_logprobs(model, [PAIRS[i] for i in BATCHES[0]])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_what_the_attention_cannot_honour_is_refused_by_name():
    layer = torch.nn.Module().train()
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="attention dropout"):
        invariant_attention_forward(layer, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="boolean masks"):
        invariant_attention_forward(layer.eval(), q, q, q, torch.zeros(1, 1, 3, 3))
    with pytest.raises(ValueError, match="transformers model"):
        with batch_invariant(torch.nn.Linear(2, 2)):
            pass


@torch.no_grad()
def test_a_cached_decode_inside_the_block_numbers_positions_from_the_mask():
    """A left-padded row decoded step by step with a cache (mask over cached and new tokens, as `generate` passes
    it) gets the bits of its forward alone."""
    model = realistic("qwen3", torch.bfloat16)
    ids, mask = torch.tensor([[0, 0, 0, 0, 0, 20, 21, 22, 4, 5]]), torch.tensor([[0] * 5 + [1] * 5])
    with batch_invariant(model):
        alone = model(input_ids=ids[:, 5:]).logits[0]
        cache = model(input_ids=ids[:, :8], attention_mask=mask[:, :8], use_cache=True).past_key_values
        step = model(input_ids=ids[:, 8:9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
    assert torch.equal(step.logits[0, -1], alone[3])


def test_mixed_precision_trains_under_the_block():
    """fp32 weights under bf16 autocast (TRL's bf16=True): the forward computes in bf16 as F.linear would, and the
    backward runs (its gradients close to the ordinary forward's)."""
    model = realistic("qwen3", torch.float32)
    pairs = [PAIRS[i] for i in BATCHES[2]]

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.cat(trl_batch_logprobs(model, pairs)).sum()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    with batch_invariant(model):
        invariant = gradients()
    norm = lambda grads: float(sum(g.float().norm() ** 2 for g in grads.values()) ** 0.5)  # noqa: E731
    assert plain.keys() == invariant.keys() and abs(norm(invariant) / norm(plain) - 1) < 0.05


@torch.no_grad()
def test_moe_experts_run_eager_inside_the_block():
    """transformers' default `grouped_mm` experts give a token bits that depend on its expert's load: inside the
    block the experts run "eager" (one F.linear each, tiled), and a row in a batch equals the row alone."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    before = model.get_experts_implementation()
    assert before[""] != "eager"
    with batch_invariant(model):
        assert model.config._experts_implementation == "eager"
        assert largest_gap(model, BATCHES) == 0.0
    assert model.get_experts_implementation() == before


def test_a_left_padded_row_that_sees_no_key_gets_no_gradient_blowup():
    """A loss that also reaches the left padding (its queries see no key), scaled as a GradScaler scales it: every
    gradient stays finite under the mode, as under the ordinary forward."""
    model = realistic("qwen3", torch.float32)
    ids, mask = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]]), torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    with batch_invariant(model):
        (model(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).sum() * 100).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)

"""The Triton paged-attention kernels against a plain PyTorch reference: on CUDA when there is one, else on the CPU
with Triton's interpreter (conftest sets TRITON_INTERPRET=1 before anything imports triton)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from conftest import needs_triton_interpreter  # noqa: E402
from rollout.engine.attention.kernel_plan import Tiling, plan, plan_splits  # noqa: E402
from rollout.engine.attention.triton_kernel import paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(query, key_cache, value_cache, block_tables, contexts, query_lens, scale, window, softcap):
    """Per sequence and head: gather the sequence's keys/values from its blocks, mask, softmax in float64."""
    outputs = []
    start = 0
    heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    for seq, (context, length) in enumerate(zip(contexts, query_lens)):
        total = context + length
        blocks = block_tables[seq]
        keys = key_cache[blocks].flatten(0, 1)[:total].double()  # (total, Hkv, D)
        values = value_cache[blocks].flatten(0, 1)[:total].double()
        q = query[start : start + length].double()  # (length, H, D)
        keys = keys.repeat_interleave(heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(context, total).unsqueeze(1)
        key_pos = torch.arange(total).unsqueeze(0)
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= key_pos > query_pos - window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += length
    return torch.cat(outputs)


def make_case(contexts, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in zip(contexts, query_lens)]
    num_blocks = sum(blocks_per_seq) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered through the cache
    tables, used = [], 0
    for count in blocks_per_seq:
        tables.append(order[used : used + count])
        used += count
    width = max(blocks_per_seq)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(sum(query_lens), heads, head_dim, generator=generator).to(DEVICE, dtype)
    return query, key_cache, value_cache, block_table, tables


# The default tiling (several 16-token blocks per loop iteration, four programs per SM), and its one-block loop (what
# it takes for blocks of 64 tokens or more), here at 16-token blocks.
TILINGS = {"multi_block": Tiling(), "one_block": Tiling(keys_per_iteration=16)}

CASES = {
    # name: (contexts, query lengths, heads, kv heads, head dim)
    "decode": ([5, 40, 17, 63], [1, 1, 1, 1], 4, 2, 32),
    "prefill": ([0, 0], [37, 20], 4, 2, 32),
    "chunked_prefill_mixed": ([33, 0, 70, 12], [1, 25, 19, 1], 8, 2, 64),
    "mha_odd_head_dim": ([10, 3], [7, 1], 3, 3, 40),
    "gqa_4": ([50], [18], 8, 2, 16),
}


KERNEL_CASES = [
    (name, window, softcap, tiling)
    for name in sorted(CASES)
    for window, softcap in [(None, None), (24, None), (None, 30.0), (9, 5.0)]
    for tiling in sorted(TILINGS)
    if tiling == "multi_block" or (window, softcap) in [(None, None), (9, 5.0)]  # the one-block loop: a subset
]


@needs_triton_interpreter
@pytest.mark.parametrize("name, window, softcap, tiling", KERNEL_CASES)
def test_kernel_matches_reference(name, window, softcap, tiling):
    contexts, query_lens, heads, kv_heads, head_dim = CASES[name]
    query, key_cache, value_cache, block_table, tables = make_case(
        contexts, query_lens, heads, kv_heads, head_dim, 16, torch.float32
    )
    scale = head_dim**-0.5
    hpk = heads // kv_heads
    attention_plan = plan(query_lens, contexts, block_table, hpk, kv_heads, 16, DEVICE, 1, TILINGS[tiling])
    assert attention_plan.blocks_per_iter == (1 if tiling == "one_block" else 4)
    got = paged_attention(query, key_cache, value_cache, attention_plan, scale, window, softcap)
    expected = reference(query, key_cache, value_cache, tables, contexts, query_lens, scale, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@needs_triton_interpreter
@pytest.mark.parametrize("tiling", sorted(TILINGS))
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 40])
def test_split_k_matches_reference(splits, window, tiling):
    """Long decodes split over the block table: the merged slices equal the unsplit result, including slices that
    see no key at all (short sequences, or keys outside the window) and slices whose blocks are not a multiple of
    the blocks read per iteration."""
    contexts, query_lens = [150, 3, 97, 64], [1, 1, 1, 2]
    query, key_cache, value_cache, block_table, tables = make_case(contexts, query_lens, 8, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    attention_plan = plan(query_lens, contexts, block_table, 4, 2, 16, DEVICE, splits, TILINGS[tiling])
    assert attention_plan.num_splits == splits
    got = paged_attention(query, key_cache, value_cache, attention_plan, scale, window, None)
    expected = reference(query, key_cache, value_cache, tables, contexts, query_lens, scale, window, None)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@needs_triton_interpreter
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("splits, window", [(1, None), (2, 100)])
def test_blocks_wider_than_a_key_chunk_match_reference(block_size, splits, window):
    """Cache blocks of 128 and 256 tokens are read 64 keys at a time (the chunks past a sequence's last key are
    masked, the slots there may hold NaN): a decode, a prefill and a chunked prefill crossing blocks equal the
    reference, split over the block table or not."""
    contexts, query_lens = [300, 0, 130], [1, 70, 20]
    query, key_cache, value_cache, block_table, tables = make_case(
        contexts, query_lens, 4, 2, 32, block_size, torch.float32
    )
    for table, context, length in zip(tables, contexts, query_lens):
        key_cache[table[-1], context + length - (len(table) - 1) * block_size :] = float("nan")
    attention_plan = plan(query_lens, contexts, block_table, 2, 2, block_size, DEVICE, splits)
    got = paged_attention(query, key_cache, value_cache, attention_plan, 32**-0.5, window, None)
    expected = reference(query, key_cache, value_cache, tables, contexts, query_lens, 32**-0.5, window, None)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


@needs_triton_interpreter
def test_bf16_within_bf16_tolerance():
    contexts, query_lens = [20, 0], [1, 30]
    query, key_cache, value_cache, block_table, tables = make_case(contexts, query_lens, 4, 2, 64, 16, torch.bfloat16)
    attention_plan = plan(query_lens, contexts, block_table, 2, 2, 16, DEVICE)
    got = paged_attention(query, key_cache, value_cache, attention_plan, 0.125, None, None)
    assert got.dtype == torch.bfloat16
    expected = reference(query, key_cache, value_cache, tables, contexts, query_lens, 0.125, None, None)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


@needs_triton_interpreter
@pytest.mark.parametrize("tiling", sorted(TILINGS))
@pytest.mark.parametrize("splits", [1, 2])
def test_unwritten_slots_holding_nan_never_reach_the_output(splits, tiling):
    """Each sequence's last block holds NaN past its last key, as a previous owner of the block may have left it
    (a masked score is selected away, but 0 * NaN in the value product would not be): the kernel loads no key past a
    tile's last query, so the output equals the reference over the written keys."""
    contexts, query_lens = [5, 40, 0, 70], [1, 3, 21, 1]
    query, key_cache, value_cache, block_table, tables = make_case(contexts, query_lens, 4, 2, 32, 16, torch.float32)
    for table, context, length in zip(tables, contexts, query_lens):
        written = context + length - (len(table) - 1) * 16  # keys of the sequence in its last block
        key_cache[table[-1], written:] = float("nan")
        value_cache[table[-1], written:] = float("nan")
    attention_plan = plan(query_lens, contexts, block_table, 2, 2, 16, DEVICE, splits, TILINGS[tiling])
    got = paged_attention(query, key_cache, value_cache, attention_plan, 32**-0.5, None, None)
    expected = reference(query, key_cache, value_cache, tables, contexts, query_lens, 32**-0.5, None, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)


def test_small_block_size_is_refused():
    query, key_cache, value_cache, block_table, _ = make_case([3], [1], 2, 1, 16, 8, torch.float32)
    attention_plan = plan([1], [3], block_table, 2, 1, 8, DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(query, key_cache, value_cache, attention_plan, 0.25)


@needs_triton_interpreter
@pytest.mark.parametrize("kind", ["qwen3", "mistral_sliding", "gemma2"])
def test_engine_with_triton_backend_matches_generate(kind):
    """The whole engine on the Triton kernel (chunked prefill, decode, a shared group prefix): greedy tokens equal
    transformers' generate; on GPU with CUDA, on CPU in the interpreter."""
    from test_parity import GREEDY, reference_greedy

    from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model

    model = tiny_model(kind).to(DEVICE)
    reference = reference_copy(model)
    prompts = make_prompts(3, 20, 40, seed=5)
    engine = make_engine(model, num_blocks=64, block_size=16, max_batch_tokens=32, attention_backend="triton")
    assert engine.runner.heads_per_kv is not None
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=10)
    outputs = run_to_completion(engine)
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, 10), index
    engine.close()


def test_backend_choice():
    """auto picks PyTorch off CUDA; triton is refused with a block size it cannot serve, naming the field."""
    from conftest import make_engine, tiny_model
    from rollout.config import ContinuousBatchingConfig, FieldError

    engine = make_engine(tiny_model("qwen3").to(DEVICE), block_size=16)
    assert (engine.runner.heads_per_kv is None) == (DEVICE.type != "cuda")
    engine.close()
    with pytest.raises(FieldError) as raised:
        make_engine(tiny_model("qwen3"), block_size=8, attention_backend="triton")
    assert raised.value.field == "attention_backend"
    with pytest.raises(ValueError):
        ContinuousBatchingConfig(attention_backend="flash")


def test_split_counts_are_few_powers_of_two_with_long_enough_slices():
    """NUM_SPLITS is a compile-time constant of the kernel: every count plan_splits picks is one of five powers of
    two (each is a separate compilation), and every slice still covers at least 8 key blocks."""
    counts = {}
    for tiles in range(1, 80):
        for max_blocks in range(1, 3000, 7):
            splits = plan_splits(tiles, 4, max_blocks)
            counts[splits] = counts.get(splits, 0) + 1
            assert splits == 1 or max_blocks // splits >= 8, (tiles, max_blocks, splits)
    assert set(counts) == {1, 2, 4, 8, 16}, counts


def test_default_tiling_plans_four_programs_per_sm_for_mid_size_decodes():
    """On an H100 (132 SMs) a decode of 8-64 sequences of 4k tokens over 8 KV heads plans at least 4 programs per
    SM (split-K fills what the tiles do not), reading four 16-token blocks per loop iteration."""
    current = Tiling.for_device(torch.device("cpu"))
    for batch in (8, 16, 32, 64):
        splits = plan_splits(batch, 8, 256, current.target_programs)
        assert batch * 8 * splits >= 4 * 132, (batch, splits)
    assert current.blocks_per_iter(16) == 4 and current.blocks_per_iter(64) == 1 and current.blocks_per_iter(128) == 1

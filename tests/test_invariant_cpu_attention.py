"""The CPU's batch-invariant products (`attend_in_torch`, `tiled_matmul`): the last few queries of a sequence attended
alone (a decode step, a verify step, a chunk of a prefill) get the bits of the same queries inside the whole prefill
(the trainer's forward), and a linear's rows the bits they have among any other rows, whatever the group of heads
sharing a key head and the thread count. On an AMD EPYC, MKL took other kernels for some rows of products of 1 to 3
rows (one thread), of up to 11 rows but 4 and 8 (two threads), and of 17-19 and 25-27 rows (sixteen threads): a
decode step padded to 3 rows was off the trainer by up to 1e-5 in fp32. Every product now has a multiple of 4 rows
(16 before: 4 times the work of a decode step's attention), which gave one thread's bits with 1 to 32 threads there;
an Intel Sapphire Rapids needed 16 for the linears' 256-long reductions, so the bound is the one `check_cpu_products`
chose on this machine, and the linears' test asks the check first."""

from __future__ import annotations

import pytest
import torch

from rollout.invariant.cpu_attention import attend_in_torch
from rollout.invariant.cpu_check import check_cpu_products
from rollout.invariant.matmul import tiled_matmul

# More threads than cores too: MKL splits a product by the thread count it is told.
THREADS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
LAST = tuple(range(1, 34))


@pytest.fixture
def threads():
    """Restores the process's thread count after the test changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_the_last_queries_alone_get_their_bits_in_the_whole_prefill(threads, num_threads, group):
    generator = torch.Generator().manual_seed(group)
    kv_heads, length, head_dim = 2, 150, 64
    query = torch.randn(1, kv_heads * group, length, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    causal = (torch.arange(length)[None, :] <= torch.arange(length)[:, None])[None, None]
    torch.set_num_threads(1)
    whole = attend_in_torch(query, key, value, causal, None, head_dim**-0.5)
    torch.set_num_threads(num_threads)
    for last in LAST:
        alone = attend_in_torch(query[:, :, -last:], key, value, causal[:, :, -last:], None, head_dim**-0.5)
        assert torch.equal(alone, whole[:, :, -last:]), f"the last {last} queries alone differ"


@pytest.mark.parametrize("num_threads", THREADS)
def test_a_linears_rows_get_the_same_bits_among_any_other_rows(threads, num_threads):
    """Under the bound the check chose for the shape with this thread count, from its sample of row counts, every
    count up to 33 and two more hold."""
    generator = torch.Generator().manual_seed(0)
    rows, weight = torch.randn(300, 512, generator=generator), torch.randn(384, 512, generator=generator)
    torch.set_num_threads(num_threads)
    check_cpu_products(torch.nn.Linear(512, 384, bias=False))
    torch.set_num_threads(1)
    whole = tiled_matmul(rows, weight)
    torch.set_num_threads(num_threads)
    for count in LAST + (48, 100):
        assert torch.equal(tiled_matmul(rows[:count], weight), whole[:count]), f"{count} rows differ"


def test_autocast_leaves_the_attention_in_fp32():
    """A trainer under autocast (TRL's bf16=True on fp32 weights) attends in fp32, as the engine does: the same bits
    with and without autocast (bf16 products were 0.016 off)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 40, 64, generator=generator)
    key, value = (torch.randn(2, 2, 40, 64, generator=generator) for _ in range(2))
    causal = (torch.arange(40)[None, :] <= torch.arange(40)[:, None])[None, None].expand(2, 1, 40, 40)
    plain = attend_in_torch(query, key, value, causal, None, 0.125)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attend_in_torch(query, key, value, causal, None, 0.125), plain)

"""The CPU's batch-invariant attention (`attend_in_torch`): the last few queries of a sequence attended alone (a
decode step, a verify step, a chunk of a prefill) get the bits of the same queries inside the whole prefill (the
trainer's forward), whatever the group of heads sharing a key head and the thread count. On an AMD EPYC, MKL took
other kernels for products of 1 to 3 rows (one thread) or of up to 11 rows but 4 and 8 (two threads): a decode step
padded to 3 rows was off the trainer by up to 1e-5 in fp32 until every product had 16 rows or more."""

from __future__ import annotations

import pytest
import torch

from rollout.invariant.cpu_attention import attend_in_torch


@pytest.fixture
def threads():
    """Restores the process's thread count after the test changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_the_last_queries_alone_get_their_bits_in_the_whole_prefill(threads, num_threads, group):
    torch.set_num_threads(num_threads)
    generator = torch.Generator().manual_seed(group)
    kv_heads, length, head_dim = 2, 150, 64
    query = torch.randn(1, kv_heads * group, length, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    causal = (torch.arange(length)[None, :] <= torch.arange(length)[:, None])[None, None]
    whole = attend_in_torch(query, key, value, causal, None, head_dim**-0.5)
    for last in (1, 2, 3, 5, 6, 7, 9, 11, 17):
        alone = attend_in_torch(query[:, :, -last:], key, value, causal[:, :, -last:], None, head_dim**-0.5)
        assert torch.equal(alone, whole[:, :, -last:]), f"the last {last} queries alone differ"

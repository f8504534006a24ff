"""`cpu_offload_space` (`rollout-worker --cpu-offload-space`) checked when the cache is built: a size that holds no
block gave no swap without a word, and one the host's RAM cannot hold failed in torch's allocator with a traceback,
after the model had loaded."""

from __future__ import annotations

import pytest

from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.presets import tiny_model


@pytest.mark.parametrize(
    "space, message",
    [
        (1e-5, "cpu_offload_space: 1e-05 GiB holds no KV block of"),
        (1e6, "cpu_offload_space: 1e+06 GiB of swap need 1000000.00 GiB but the host has"),
    ],
)
def test_a_swap_space_that_cannot_work_is_refused_by_name(space, message):
    with pytest.raises(FieldError) as error:
        PagedKVCache.for_model(tiny_model(), ContinuousBatchingConfig(num_blocks=8, cpu_offload_space=space), 64, False)
    assert str(error.value).startswith(message)


def test_a_swap_space_that_fits_gives_its_blocks():
    cache = PagedKVCache.for_model(
        tiny_model(), ContinuousBatchingConfig(num_blocks=8, cpu_offload_space=0.01), 64, False
    )
    assert cache.num_swap_blocks > 0 and cache.swap is not None

"""A colocated engine keeps its decode graphs across sleep() while the cache and the parameters come back where the
graphs read them, and drops them (to capture again) exactly when either moved. On CPU the graphs run their padded buffers eagerly (capture=False), so what is
checked is which releases happen, and that tokens equal transformers' greedy `generate` throughout."""

from __future__ import annotations

import torch

from conftest import make_prompts, needs_triton_interpreter, reference_copy
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.presets import tiny_model
from trainer_bridge import ColocatedEngine, PromptGroup

GREEDY = SamplingParams(do_sample=False, max_new_tokens=4, stop_token_ids=())
PROMPTS = make_prompts(2, 5, 9, seed=4, vocab=1024)


def _engine() -> tuple[ColocatedEngine, list[int]]:
    """A colocated engine on the Triton path (interpreted) with decode graphs, and a log of graph releases."""
    config = ContinuousBatchingConfig(num_blocks=32, attention_backend="triton")
    engine = ColocatedEngine(tiny_model(0), config)
    graphs = engine.engine.runner.enable_decode_graphs(4, 64, capture=False)
    releases: list[int] = []
    release = graphs.release
    graphs.release = lambda: (releases.append(1), release())[1]
    return engine, releases


def _round(engine: ColocatedEngine) -> list[list[int]]:
    results = engine.generate([PromptGroup(prompt, sampling=GREEDY) for prompt in PROMPTS])
    return [result.completions[0].token_ids for result in results]


def _expected() -> list[list[int]]:
    reference = reference_copy(tiny_model(0))
    outputs = []
    for prompt in PROMPTS:
        ids = reference.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@needs_triton_interpreter
def test_graphs_are_kept_while_the_cache_comes_back_in_place_and_dropped_when_it_moved():
    engine, releases = _engine()
    expected = _expected()
    assert _round(engine) == expected
    for _ in range(2):  # whatever the allocator does, graphs are dropped exactly when the cache moved
        before = engine.engine.kv_cache.kv.data_ptr()
        engine.sleep()
        engine.wake()
        moved = engine.engine.kv_cache.kv.data_ptr() != before
        assert releases.pop() if moved else not releases
        assert _round(engine) == expected
    held = engine.engine.kv_cache.kv  # the old cache cannot be freed: the new one must land elsewhere
    engine.sleep()
    engine.wake()
    assert engine.engine.kv_cache.kv.data_ptr() != held.data_ptr() and releases == [1]
    assert _round(engine) == expected
    engine.close()


def test_speculative_decodings_verify_graphs_are_dropped_with_the_decode_graphs():
    """The verify graphs of drafted steps read the cache and the parameters as the decode graphs do: when the cache
    moves (or `sleep(graphs=True)`), both are dropped, never the decode graphs alone (a verify graph replayed over a
    freed cache on a GPU reads memory the training step now owns)."""
    config = ContinuousBatchingConfig(
        num_blocks=32, attention_backend="triton", speculative="suffix", num_speculative_tokens=3
    )
    engine = ColocatedEngine(tiny_model(0), config)
    engine.engine.runner.enable_decode_graphs(4, 64, capture=False)
    runner_graphs = engine.engine.runner.graphs
    assert runner_graphs.verify is not None
    releases: dict[str, int] = {"decode": 0, "verify": 0}

    def counted(name: str, release):  # noqa: ANN001, ANN202
        def each() -> None:
            releases[name] += 1
            release()

        return each

    for name in releases:
        graphs = getattr(runner_graphs, name)
        graphs.release = counted(name, graphs.release)
    held = engine.engine.kv_cache.kv  # the old cache cannot be freed: the new one must land elsewhere
    engine.sleep()
    engine.wake()
    assert engine.engine.kv_cache.kv.data_ptr() != held.data_ptr()
    assert releases == {"decode": 1, "verify": 1}
    engine.sleep(graphs=True)
    assert releases == {"decode": 2, "verify": 2}
    engine.close()

"""GPU tests of the sampler's captured passes (`SamplerGraphs`, `pytest -m gpu tests/gpu`): on CUDA, wherever decode
steps replay graphs, sampling replays captured passes too. Skipped without CUDA (CPU tests run the same buffers with
capture off: tests/test_sampler_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from test_gpu import small_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _samplings() -> list:
    from rollout.config import SamplingParams

    return [
        SamplingParams(do_sample=False, stop_token_ids=(), top_logprobs=3),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1, stop_token_ids=()),
        SamplingParams(temperature=1.0, min_p=0.05, logprob_mode="raw", seed=2, stop_token_ids=()),
        SamplingParams(temperature=0.7, top_p=0.95, logprob_mode="temperature_scaled", seed=3, stop_token_ids=()),
        SamplingParams(temperature=1.0, top_k=20, seed=4, stop_token_ids=(), top_logprobs=2),
    ]


def _run(engine, prompts: list[list[int]], prefix: str) -> dict:
    for index, (prompt, sampling) in enumerate(zip(prompts, _samplings())):
        engine.add_request(f"{prefix}{index}", prompt, sampling, n=2, max_new_tokens=24)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.is_finished})
    return {key: (o.generated_tokens, o.logprobs, o.top_logprobs) for key, o in outputs.items()}


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "invariant"])
def test_sampler_graphs_draw_what_the_eager_sampler_draws(batch_invariant):
    """The same model and requests with the sampler's graphs and without (the decode graphs on in both, so the
    logits are the same): the same tokens and top log-prob tokens, and the same log-probs (bit for bit under
    batch_invariant; otherwise a bucket's padded reductions may round differently), most steps served by a replay.
    A third round of the same requests replays what the first two captured, and queues no host synchronisation."""
    from rollout.config import ContinuousBatchingConfig
    from rollout.engine.engine import Engine

    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 4096, (int(n),), generator=generator).tolist() for n in (25, 80, 150, 40, 60)]
    dtype = torch.bfloat16 if batch_invariant else torch.float32
    results = []
    for graphs in (True, False):
        engine = Engine(small_qwen3(dtype), ContinuousBatchingConfig(num_blocks=256, batch_invariant=batch_invariant))
        assert engine.sampler.graphs is not None, "sampler graphs follow the decode graphs"
        if not graphs:
            engine.sampler.release_graphs()
            engine.sampler.graphs = None
        results.append(_run(engine, prompts, "a"))
        if graphs:
            sampler_graphs = engine.sampler.graphs
            assert sampler_graphs.disabled_reason is None, sampler_graphs.disabled_reason
            assert sampler_graphs.replays >= engine.counters.steps // 3, "most steps should replay a pass"
            # A pass is captured at its second sighting: a second round captures those the first needed once.
            engine.block_manager.reset_prefix_cache()  # the same schedule again: the same buckets and decisions
            _run(engine, prompts, "a")
            captures, replays = sampler_graphs.captures, sampler_graphs.replays
            launch = engine.loop._launch

            def watched(*args, _launch=launch):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return _launch(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            engine.loop._launch = watched
            engine.block_manager.reset_prefix_cache()  # the same schedule again: the same buckets and decisions
            again = _run(engine, prompts, "a")
            assert sampler_graphs.disabled_reason is None, sampler_graphs.disabled_reason
            assert sampler_graphs.captures == captures, "the third round should find every pass captured"
            assert sampler_graphs.replays > replays
            if batch_invariant:
                assert again == results[0], "a replay of the same requests draws the same tokens"
        engine.close()
    graphed, eager = results
    assert graphed.keys() == eager.keys()
    for key, (tokens, logprobs, top) in eager.items():
        assert graphed[key][0] == tokens, key
        assert [[t for t, _ in row] for row in graphed[key][2]] == [[t for t, _ in row] for row in top], key
        if batch_invariant:
            assert graphed[key][1] == logprobs and graphed[key][2] == top, key
        else:
            assert torch.allclose(torch.tensor(graphed[key][1]), torch.tensor(logprobs), atol=1e-5), key

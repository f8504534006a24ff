"""Routing replay around each step of a `torch.compile`d MoE model (`with routing_replay(model, routes): compiled(...)`
every step): every forward routes by its own step's routes, and the code compiled in the first step is kept (it was
dropped, and everything compiled in the process with it, at every step's `routing_replay`: a whole recompile per
training step). Code compiled while the routers had no hooks (a forward outside any replay) is still dropped once a
replay arrives, or that replay would route nothing.

References: the same model's eager forward under the same routes, transformers' own forward without routes, and
dynamo's own count of compiled frames."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import reference_copy, tiny_model
from trainer_bridge.route_replay import routing_replay

TOP_K = 2


def random_routes(generator: torch.Generator, length: int) -> torch.Tensor:
    """(1, length, 2 layers, TOP_K) distinct expert ids per token among the tiny Qwen3-MoE's 4."""
    rows = [torch.randperm(4, generator=generator)[:TOP_K] for _ in range(length * 2)]
    return torch.stack(rows).reshape(1, length, 2, TOP_K)


@pytest.mark.filterwarnings("ignore")
def test_replay_around_each_step_of_a_compiled_model_keeps_its_compiled_code():
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe", seed=3)
    eager = reference_copy(model)
    compiled = torch.compile(model, backend="eager")
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 9, 17, 33, 65, 129]])
    with torch.no_grad():
        natural = eager(input_ids=ids).logits
        steps = [random_routes(generator, ids.shape[1]) for _ in range(3)]
        expected = []
        for routes in steps:
            with routing_replay(eager, routes):
                expected.append(eager(input_ids=ids).logits)
            assert not torch.equal(expected[-1], natural), "these routes change nothing: the check would be vacuous"
        compiled_frames = []
        for step, routes in enumerate(steps):  # a training loop: only replayed forwards
            before = counters["frames"]["ok"]
            with routing_replay(model, routes):
                assert torch.equal(compiled(input_ids=ids).logits, expected[step]), step
            compiled_frames.append(counters["frames"]["ok"] - before)
        assert compiled_frames[0] > 0 and compiled_frames[1:] == [0, 0], compiled_frames

        # Outside any replay the routers decide (dynamo compiles this forward again, the routers without hooks);
        # a replay after it still routes (that code is dropped for code that calls the hooks).
        assert torch.equal(compiled(input_ids=ids).logits, natural)
        routes = random_routes(generator, ids.shape[1])
        with routing_replay(eager, routes):
            expected = eager(input_ids=ids).logits
        with routing_replay(model, routes):
            assert torch.equal(compiled(input_ids=ids).logits, expected)
        assert torch.equal(compiled(input_ids=ids).logits, natural)

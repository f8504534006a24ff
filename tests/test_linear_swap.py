"""`rollout.invariant.linear_swap`: a model's `nn.Linear` modules compute as `invariant_linear` on the thread inside
`swapped_linears` only, nothing stays on the model after the last holder leaves, modules with a forward of someone
else's are left alone, and the engine keeps `InvariantLinearMode` exactly when its first forward shows a linear the
swap cannot see (an MoE model's eager experts) or a kernel device."""

from __future__ import annotations

import threading

import torch

from conftest import make_engine, make_prompts, run_to_completion, tiny_model
from rollout import SamplingParams
from rollout.invariant.linear_swap import ModeNeed, swapped_linears
from rollout.invariant.matmul import invariant_linear
from rollout.invariant.mode import InvariantLinearMode


def _fingerprint(layer: torch.nn.Linear, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the layer computes for the last row within a batch of all rows, alone): invariant_linear gives both the
    same bits, F.linear need not."""
    return layer(rows)[-1], layer(rows[-1:])[0]


@torch.no_grad()
def test_the_swap_acts_on_the_asking_thread_only_and_leaves_nothing_behind():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.ReLU(), torch.nn.Linear(300, 7))
    rows = torch.randn(33, 512)
    seen_elsewhere = {}

    def other_thread() -> None:
        seen_elsewhere["out"] = model[0](rows)
        seen_elsewhere["swapped"] = "forward" in model[0].__dict__

    with swapped_linears(model):
        in_batch, alone = _fingerprint(model[0], rows)
        assert torch.equal(in_batch, alone)
        assert torch.equal(model[0](rows), invariant_linear(rows, model[0].weight, model[0].bias))
        with swapped_linears(model):  # reentrant: the inner exit keeps the outer swap
            pass
        assert "forward" in model[0].__dict__
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen_elsewhere["swapped"]  # the swap was in place, yet the other thread got nn.Linear's own forward
    assert torch.equal(seen_elsewhere["out"], torch.nn.functional.linear(rows, model[0].weight, model[0].bias))
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    assert torch.equal(model[0](rows), torch.nn.functional.linear(rows, model[0].weight, model[0].bias))


@torch.no_grad()
def test_a_module_with_a_forward_of_someone_elses_is_left_alone():
    layer = torch.nn.Linear(8, 4)

    def hooked(x: torch.Tensor) -> torch.Tensor:  # as accelerate's hooks install one
        return torch.nn.Linear.forward(layer, x) * 2

    layer.forward = hooked
    with swapped_linears(layer):
        assert layer.forward is hooked
    assert layer.forward is hooked


def test_the_mode_is_kept_when_the_first_forward_shows_a_linear_the_swap_cannot_see():
    need = ModeNeed()
    with InvariantLinearMode() as mode:
        torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))  # a custom layer's own F.linear
    need.learn(mode, torch.zeros(1))
    assert need.needed is True
    quiet = ModeNeed()
    with InvariantLinearMode() as mode:
        torch.randn(2, 3).sum()
    quiet.learn(mode, torch.zeros(1))
    assert quiet.needed is False


def test_an_engine_drops_the_mode_for_a_dense_model_and_keeps_it_for_eager_experts():
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    for kind, needed in (("qwen3", False), ("qwen3_moe", True)):
        engine = make_engine(tiny_model(kind), batch_invariant=True)
        engine.add_request("x", make_prompts(1, 9, 9)[0], greedy, max_new_tokens=3)
        run_to_completion(engine)
        assert engine.runner._forward.mode_need.needed is needed, kind
        engine.close()

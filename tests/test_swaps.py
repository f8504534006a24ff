"""`rollout.invariant.swaps`: a model's `nn.Linear` modules compute as `invariant_linear` on the thread inside
`swapped_forwards` only, nothing stays on the model after the last holder leaves, modules with a forward of someone
else's are left alone, and the engine keeps `InvariantLinearMode` exactly when its first forward shows a linear the
swap cannot see (an MoE model's eager experts) or a kernel device."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from transformers.activations import GELUActivation, MishActivation

from conftest import make_engine, make_prompts, run_to_completion, tiny_model
from rollout import SamplingParams
from rollout.invariant.activations import (
    invariant_gelu_erf,
    invariant_gelu_tanh,
    invariant_mish,
    invariant_silu,
    invariant_softplus,
)
from rollout.invariant.cpu_check import check_cpu_products
from rollout.invariant.matmul import invariant_linear
from rollout.invariant.mode import InvariantLinearMode
from rollout.invariant.swaps import ModeNeed, foreign_forwards, swapped_forwards


def _fingerprint(layer: torch.nn.Linear, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the layer computes for the last row within a batch of all rows, alone): invariant_linear gives both the
    same bits, F.linear need not."""
    return layer(rows)[-1], layer(rows[-1:])[0]


@torch.no_grad()
def test_the_swap_acts_on_the_asking_thread_only_and_leaves_nothing_behind():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.ReLU(), torch.nn.Linear(300, 7))
    check_cpu_products(model)  # the row bound this CPU needs (16 on an AVX-512 FP16 Xeon), as batch_invariant sets it
    rows = torch.randn(33, 512)
    seen_elsewhere = {}

    def other_thread() -> None:
        seen_elsewhere["out"] = model[0](rows)
        seen_elsewhere["swapped"] = "forward" in model[0].__dict__

    with swapped_forwards(model):
        in_batch, alone = _fingerprint(model[0], rows)
        assert torch.equal(in_batch, alone)
        assert torch.equal(model[0](rows), invariant_linear(rows, model[0].weight, model[0].bias))
        with swapped_forwards(model):  # reentrant: the inner exit keeps the outer swap
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
    with swapped_forwards(layer):
        assert layer.forward is hooked
    assert layer.forward is hooked


def test_the_mode_is_kept_when_the_first_forward_shows_a_linear_the_swap_cannot_see():
    need, layer = ModeNeed(), torch.nn.Linear(3, 4)
    with InvariantLinearMode() as mode:
        torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))  # a custom layer's own F.linear
    need.learn(mode, layer)
    assert need.needed(layer) is True
    assert need.needed(torch.nn.Linear(3, 4).bfloat16()) is None  # learnt per device type and dtype
    quiet = ModeNeed()
    with InvariantLinearMode() as mode:
        torch.randn(2, 3).sum()
    quiet.learn(mode, layer)
    assert quiet.needed(layer) is False
    layer.forward = lambda x: torch.nn.functional.linear(x, layer.weight)  # e.g. TRL's fp32 head, set since
    assert quiet.needed(layer) is None  # learnt again: the new forward may call what no swap sees


def test_an_engine_drops_the_mode_for_a_dense_model_and_keeps_it_for_eager_experts():
    greedy = SamplingParams(do_sample=False, stop_token_ids=())
    for kind, needed in (("qwen3", False), ("qwen3_moe", True)):
        engine = make_engine(tiny_model(kind), batch_invariant=True)
        engine.add_request("x", make_prompts(1, 9, 9)[0], greedy, max_new_tokens=3)
        run_to_completion(engine)
        assert engine.runner._forward.mode_need.needed(engine.runner.model) is needed, kind
        engine.close()


def test_a_forward_that_raised_teaches_nothing_and_a_kernel_device_keeps_the_mode(monkeypatch):
    """A first forward that fails (a bad token id) leaves the need unknown, so an MoE model's next forward is still
    under the mode; on a kernel device (stood in for here) the engine keeps the mode for a dense model too."""
    from rollout.invariant import swaps
    from trainer_bridge import batch_invariant

    model = tiny_model("qwen3_moe")
    with torch.no_grad(), batch_invariant(model):
        try:
            model(input_ids=torch.tensor([[10**6]]))
        except IndexError:
            pass
        assert swaps.mode_need_of(model).needed(model) is None
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert swaps.mode_need_of(model).needed(model) is True
    monkeypatch.setattr(swaps, "on_kernel_device", lambda x: True)
    engine = make_engine(tiny_model("qwen3"), batch_invariant=True)
    engine.add_request("x", make_prompts(1, 5, 5)[0], SamplingParams(do_sample=False), max_new_tokens=2)
    run_to_completion(engine)
    assert engine.runner._forward.mode_need.needed(engine.runner.model) is True
    engine.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_swapped_activations_give_a_row_its_bits_wherever_it_sits(threads):
    """torch's SiLU and tanh-GELU round the elements a thread's SIMD loop leaves over otherwise (a row's bits depend
    on the tensor's size); the swapped functions do not, and stay within float rounding of torch's."""
    torch.manual_seed(threads)
    rows = torch.randn(257, 300)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    F = torch.nn.functional
    try:
        torch_moved = 0
        for ours, theirs in (
            (invariant_silu, torch.nn.functional.silu),
            (invariant_gelu_tanh, functools.partial(torch.nn.functional.gelu, approximate="tanh")),
            (invariant_gelu_erf, torch.nn.functional.gelu),
            (invariant_mish, torch.nn.functional.mish),
            (invariant_softplus, torch.nn.functional.softplus),
            (
                functools.partial(invariant_softplus, beta=2.0, threshold=3.0),
                functools.partial(F.softplus, beta=2.0, threshold=3.0),
            ),
        ):
            together, by_torch = ours(rows), theirs(rows)
            for first in (0, 5, 100, 256):
                assert torch.equal(ours(rows[first : first + 1])[0], together[first])
                torch_moved += not torch.equal(theirs(rows[first : first + 1])[0], by_torch[first])
            torch.testing.assert_close(together, by_torch, atol=1e-6, rtol=1e-6)
        assert torch_moved > 0  # the comparison can fail: torch's own do move
    finally:
        torch.set_num_threads(previous)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.GELU(approximate="tanh"), torch.nn.GELU(), GELUActivation(),
        torch.nn.Mish(), MishActivation(),
    )  # fmt: skip
    with swapped_forwards(model):
        swapped = [type(m).__name__ for m in model.modules() if "forward" in m.__dict__]
        assert swapped == ["Linear", "SiLU", "GELU", "GELU", "GELUActivation", "Mish", "MishActivation"]
    assert not [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize(
    "ours, theirs",
    [(invariant_softplus, torch.nn.functional.softplus), (invariant_mish, torch.nn.functional.mish)],
    ids=["softplus", "mish"],
)
def test_softplus_and_mish_keep_torchs_gradient_where_exp_overflows(ours, theirs):
    x = torch.tensor([-200.0, -3.0, 0.0, 5.0, 30.0, 200.0], requires_grad=True)
    (grad,) = torch.autograd.grad(ours(x).sum(), x)
    (expected,) = torch.autograd.grad(theirs(x).sum(), x)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, expected)


@torch.no_grad()
def test_a_model_holding_another_swapped_models_modules_keeps_what_it_learnt():
    """A wrapper swapped while the model inside it is (an engine's model and a trainer's wrapper of it): the inner
    swap's forwards are a swap's, not someone else's, so the wrapper's need learnt at one forward holds at the next
    (were they counted, each swap's new forwards made a new set: the mode ran at every forward, a new entry each)."""
    inner = torch.nn.Sequential(torch.nn.Linear(3, 3))
    outer = torch.nn.Sequential(inner, torch.nn.Linear(3, 3))
    need, rows = ModeNeed(), torch.randn(2, 3)
    for _ in range(2):
        with swapped_forwards(inner), swapped_forwards(outer):
            assert foreign_forwards(outer) == frozenset()
            if need.needed(outer) is None:
                with InvariantLinearMode() as mode:
                    outer(rows)
                need.learn(mode, outer)
            assert need.needed(outer) is False
    assert foreign_forwards(outer) == frozenset()

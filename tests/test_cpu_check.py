"""`check_cpu_products`: before a batch-invariant engine or trainer forward relies on this machine's matmuls being
row-invariant, the model's own shapes are run here against one thread's bits; a BLAS that computes some rows
otherwise is refused by name ("batch_invariant"), and nothing is left held. The failing BLAS is the real one told to
issue products of any row count (`MIN_ROWS` 1, no larger bound to try): MKL takes a matrix-vector kernel for a
single row, which sums in another order (measured on two Intel machines and an AMD one: 1e-5 off). Given larger
bounds to try, the check raises the bound in use to the first that holds on this machine."""

from __future__ import annotations

import pytest
import torch

from conftest import make_engine, tiny_model
from rollout import FieldError
from rollout.invariant import cpu_attention, cpu_check, matmul
from rollout.invariant.cpu_check import RowInvarianceError, check_cpu_products, clear_checks
from trainer_bridge import batch_invariant


@pytest.fixture
def fresh_checks(monkeypatch):
    """Every shape checked anew, the thread count and the row bounds restored after."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(matmul, "MIN_ROWS", matmul.MIN_ROWS)
    monkeypatch.setattr(cpu_attention, "MIN_QUERY_ROWS", cpu_attention.MIN_QUERY_ROWS)
    clear_checks()
    yield
    torch.set_num_threads(threads)
    clear_checks()


@pytest.fixture
def threads_two():
    torch.set_num_threads(2)  # fresh_checks restores the count


def _no_bound_but(monkeypatch, bound: int) -> None:
    """The products padded to a multiple of `bound` rows, and no larger bound to raise it to."""
    monkeypatch.setattr(matmul, "MIN_ROWS", bound)
    monkeypatch.setattr(matmul, "ROW_MULTIPLES", (bound,))


@pytest.mark.parametrize("num_threads", [1, 2, 16])
def test_the_tiny_models_products_are_row_invariant_here(fresh_checks, num_threads):
    torch.set_num_threads(num_threads)
    check_cpu_products(tiny_model())
    assert torch.get_num_threads() == num_threads  # the one-thread reference gave the count back


def test_a_product_of_single_rows_is_refused_naming_the_linear_and_the_threads(fresh_checks, monkeypatch):
    _no_bound_but(monkeypatch, 1)
    torch.set_num_threads(2)
    with pytest.raises(
        RowInvarianceError,
        match=r"linear of \d+ -> \d+ features computed 1 row alone with 2 threads .* padded to a multiple of 1,",
    ):
        check_cpu_products(tiny_model())


@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_bound_rises_to_the_first_that_holds_here_and_never_falls(fresh_checks, monkeypatch, num_threads):
    """From single rows (which no measured BLAS sums as among others), the check raises the linears' bound to a
    multiple that holds on this machine; under it a row alone has the bits it has among 96 with one thread, in
    the model's own head shape. A later check that needs less leaves the bound where it is."""
    torch.set_num_threads(num_threads)
    monkeypatch.setattr(matmul, "MIN_ROWS", 1)
    monkeypatch.setattr(matmul, "ROW_MULTIPLES", (1, 2, 4, 8, 16, 32))
    model = tiny_model()
    check_cpu_products(model)
    bound = matmul.MIN_ROWS
    assert bound > 1
    head = model.get_output_embeddings().weight.detach()
    rows = torch.randn(96, head.shape[1], generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(1)
    among = matmul.tiled_matmul(rows, head)
    torch.set_num_threads(num_threads)
    for count in (1, 3, bound + 1):
        assert torch.equal(matmul.tiled_matmul(rows[:count], head), among[:count])
    check_cpu_products(tiny_model().to(torch.bfloat16))  # its fp32 head's shape was checked under this bound
    assert matmul.MIN_ROWS == bound


def test_an_engine_and_a_trainer_forward_refuse_the_mode_where_it_cannot_hold(fresh_checks, monkeypatch):
    model = tiny_model()
    _no_bound_but(monkeypatch, 1)
    with pytest.raises(FieldError) as refused:
        make_engine(model, batch_invariant=True)
    assert refused.value.field == "batch_invariant" and "bit for bit" in refused.value.reason
    with pytest.raises(RowInvarianceError), batch_invariant(model):
        pass
    assert model.config._attn_implementation != "rollout_invariant"  # the block never took the model
    monkeypatch.setattr(matmul, "ROW_MULTIPLES", (1, 4, 8, 16, 32))
    clear_checks()
    engine = make_engine(model, batch_invariant=True)  # the same model, served once a bound holds
    engine.close()


def test_the_check_is_the_same_under_autocast_and_on_zero_weights(fresh_checks, monkeypatch):
    """What is checked is what runs (fp32 products, autocast off), on random weights of each shape: a model whose
    weights are zeros (a fresh LoRA B sums alike in any order) or a first check inside autocast decides nothing."""
    model = tiny_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_cpu_products(model)  # passes inside autocast
    check_cpu_products(model)  # and outside, from the same cache
    _no_bound_but(monkeypatch, 1)
    clear_checks()
    with pytest.raises(RowInvarianceError, match="1 row alone"), torch.autocast("cpu", dtype=torch.bfloat16):
        check_cpu_products(model)


def test_the_bound_holds_with_one_thread_too(fresh_checks, threads_two):
    """A thread that first runs torch while a reference product holds the process at one thread keeps one: the
    bound chosen with two threads must give one thread's rows the same bits (on a Sapphire Rapids an 896-wide fp32
    linear held 4 rows with two threads, not with one, which needs 16)."""
    linear = torch.nn.Linear(896, 896, bias=False)
    check_cpu_products(linear)
    rows = torch.randn(96, 896, generator=torch.Generator().manual_seed(2))
    weight = linear.weight.detach()
    torch.set_num_threads(1)
    among = matmul.tiled_matmul(rows, weight)
    for count in range(1, 2 * matmul.MIN_ROWS + 1):
        assert torch.equal(matmul.tiled_matmul(rows[:count], weight), among[:count]), count


def test_a_raised_bound_is_checked_on_the_products_passed_before(fresh_checks, monkeypatch):
    """Model A's product passed at 4; model B's needs 16; at 16 A's fails (a BLAS whose failing row counts are not
    the smallest: counts checked at 4 were not all multiples of 16), so the bound goes on to 32, where both hold.
    The BLAS is a stand-in here: a real one's failures on the machines measured were at the smallest counts."""
    fails = {(64, 300): {16}, (64, 200): {4, 8}}  # (out, in) -> the bounds under which its rows differ

    def stand_in(out_features, in_features, dtype, threads, bound):
        return f"rows of {in_features} under {bound}" if bound in fails[(out_features, in_features)] else None

    monkeypatch.setattr(cpu_check, "_linear_mismatch", stand_in)
    monkeypatch.setattr(matmul, "MIN_ROWS", 4)  # whatever an earlier test's check raised it to
    check_cpu_products(torch.nn.Linear(300, 64, bias=False))
    assert matmul.MIN_ROWS == 4
    check_cpu_products(torch.nn.Linear(200, 64, bias=False))
    assert matmul.MIN_ROWS == 32


def test_an_moe_models_expert_projections_are_checked(fresh_checks, monkeypatch):
    """The eager experts' products (one F.linear per expert, of each 3-D weight's last two dimensions) are checked
    beside the nn.Linear layers' (they had been left out)."""
    asked = []
    real = cpu_check._linear_mismatch

    def recording(out_features, in_features, dtype, threads, bound):
        asked.append((out_features, in_features))
        return real(out_features, in_features, dtype, threads, bound)

    monkeypatch.setattr(cpu_check, "_linear_mismatch", recording)
    model = tiny_model("qwen3_moe")
    check_cpu_products(model)
    experts = model.model.layers[0].mlp.experts
    for weight in (experts.gate_up_proj, experts.down_proj):
        assert tuple(weight.shape[1:]) in asked


def test_a_model_with_no_plain_linear_has_nothing_to_check(fresh_checks):
    """(A set of no products had raised StopIteration.)"""
    bound = matmul.MIN_ROWS
    check_cpu_products(torch.nn.Sequential(torch.nn.Embedding(4, 4)))
    assert matmul.MIN_ROWS == bound


def test_a_raised_bound_is_checked_with_the_thread_count_each_product_passed_with(fresh_checks, monkeypatch):
    """A passed at 4 with two threads; B, checked with three, needs 8; A's rows differ at 8 with two threads only
    (a stand-in BLAS again), so the bound goes on to 16 rather than serve A's two-thread engine unchecked."""

    def stand_in(out_features, in_features, dtype, threads, bound):
        running = torch.get_num_threads()  # what the products would really run with, whatever the message says
        assert running == threads
        if in_features == 200 and bound < 8 or (in_features, running, bound) == (300, 2, 8):
            return f"rows of {in_features} with {running} threads under {bound}"
        return None

    monkeypatch.setattr(cpu_check, "_linear_mismatch", stand_in)
    monkeypatch.setattr(matmul, "MIN_ROWS", 4)  # whatever an earlier test's check raised it to
    torch.set_num_threads(2)
    check_cpu_products(torch.nn.Linear(300, 64, bias=False))
    assert matmul.MIN_ROWS == 4
    torch.set_num_threads(3)
    check_cpu_products(torch.nn.Linear(200, 64, bias=False))
    assert matmul.MIN_ROWS == 16

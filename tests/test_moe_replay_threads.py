"""Routing replay while another thread runs the same model (docs/guides/moe.md: a replay routes the forwards of the
thread that made it, "nor a forward another thread runs meanwhile"): the other thread's forward, of another shape,
used to overwrite the shape the replaying thread's routes were checked against, and the replayed forward failed
("routes for (2, 6) tokens, the forward's input_ids (3, 5)").

References: the same routes replayed on an independent copy of the model with no other thread, and transformers' own
forward (no routes) for the other thread's tokens."""

from __future__ import annotations

import threading

import torch

from conftest import reference_copy, tiny_model
from trainer_bridge.route_replay import routing_replay


def test_a_forward_on_another_thread_inside_a_replayed_forward_leaves_it_routed():
    model = tiny_model("qwen3_moe", seed=3)
    reference = reference_copy(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 6), generator=generator)
    other_ids = torch.randint(0, 256, (3, 5), generator=generator)
    routes = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(2 * 6 * 2)]).reshape(2, 6, 2, 2)
    with torch.no_grad():
        with routing_replay(reference, routes):
            expected = reference(input_ids=ids).logits
        natural = reference(input_ids=ids).logits
        other_expected = reference(input_ids=other_ids).logits
    assert not torch.equal(expected, natural), "these routes change nothing: the check would be vacuous"

    # Deterministically inside the replayed forward (after its input ids were seen, before its first router), the
    # other thread runs a whole forward of the same model on its own tokens.
    replaying = threading.get_ident()
    other_logits = []

    def other_forward() -> None:
        with torch.no_grad():
            other_logits.append(model(input_ids=other_ids).logits)

    def meanwhile(module: torch.nn.Module, args: tuple) -> None:
        if threading.get_ident() == replaying and not other_logits:
            thread = threading.Thread(target=other_forward)
            thread.start()
            thread.join()

    hook = model.model.layers[0].register_forward_pre_hook(meanwhile)
    try:
        with routing_replay(model, routes), torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        hook.remove()
    assert len(other_logits) == 1
    assert torch.equal(logits, expected)
    assert torch.equal(other_logits[0], other_expected)  # the other thread's forward: its routers decided

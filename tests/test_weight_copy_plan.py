"""The peer weight copy's plan (`rollout.ray.weight_copy.plan_copy`): which transactions bring a restarted or lagging
fleet worker to exactly what its peer serves, base and LoRA adapters, each at its version (unloading what the peer
serves no more). The copies themselves run against real workers in test_ray.py."""

from __future__ import annotations

import pytest

from rollout.ray.weight_copy import CopyStep, plan_copy


def test_a_plain_fleet_copies_the_whole_base_at_the_peers_version():
    assert plan_copy(5, None, {}, 0, None, {}) == [CopyStep(5, None, with_base=True)]
    assert plan_copy(5, None, {}, 5, None, {}) == []


def test_a_restarted_worker_gets_the_base_with_the_first_adapter_then_each_adapter_at_its_version():
    # A trainer pushed "policy" at 3 (base included) then "ref" at 4 and "policy" again at 7.
    peer = {"policy": 7, "ref": 4, "start": 0}
    target = {"start": 0}  # loaded at start from the same --lora flags: kept
    assert plan_copy(7, "B", peer, 0, None, target) == [
        CopyStep(4, "ref", with_base=True),
        CopyStep(7, "policy", with_base=False),
    ]


def test_a_whole_push_after_the_adapters_ends_the_copy():
    plan = plan_copy(9, None, {"policy": 7}, 0, None, {})
    assert plan == [CopyStep(7, "policy", with_base=True), CopyStep(9, None, with_base=True)]


def test_a_lagging_worker_on_the_same_base_gets_only_what_it_missed():
    peer = {"policy": 8, "ref": 4}
    assert plan_copy(8, "B", peer, 7, "B", {"policy": 7, "ref": 4}) == [CopyStep(8, "policy", with_base=False)]
    # On another (or an unnamed) base the base comes along, before any adapter is served over it.
    assert plan_copy(8, "B", peer, 7, None, {"policy": 7, "ref": 4}) == [CopyStep(8, "policy", with_base=True)]


def test_a_copy_that_cannot_give_the_peers_adapters_exactly_is_refused():
    # The target (version 5) missed "ref" (version 4) while taking later pushes: a copy cannot bring it at its own
    # version, and a later tag would claim other weights.
    with pytest.raises(ValueError, match=r"lacks adapters \['ref@4'\]"):
        plan_copy(8, "B", {"policy": 8, "ref": 4}, 5, "B", {})
    with pytest.raises(ValueError, match="lacks adapters"):  # even once its version caught up
        plan_copy(8, "B", {"policy": 8, "ref": 4}, 8, "B", {"policy": 8})
    with pytest.raises(ValueError, match="lacks adapters"):  # a stale peer never rolls a newer adapter back
        plan_copy(9, "B", {"policy": 9, "ref": 4}, 7, "B", {"policy": 7, "ref": 6})


def test_an_adapter_the_peer_serves_no_more_is_unloaded_first():
    # "old" was unloaded across the fleet (unload_adapter) while the target was down; its slot is freed before the
    # adapters the target lacks arrive.
    assert plan_copy(8, "B", {"policy": 8}, 5, None, {"old": 3, "policy": 5}) == [
        CopyStep(5, "old", with_base=False, unload=True),
        CopyStep(8, "policy", with_base=True),
    ]
    assert plan_copy(8, None, {}, 5, None, {"old": 3}) == [
        CopyStep(5, "old", with_base=False, unload=True),
        CopyStep(8, None, with_base=True),
    ]
    assert plan_copy(5, None, {}, 8, None, {"new": 7}) == []  # a target newer than its peer keeps what it serves
    # An unload changes no version: at the peer's version, the adapter is unloaded alone.
    assert plan_copy(5, "B", {}, 5, "B", {"old": 3}) == [CopyStep(5, "old", with_base=False, unload=True)]

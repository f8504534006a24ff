"""`RolloutFleet.launch`'s timeouts checked on the driver before Ray starts: a timeout that is not a positive number of
seconds is a ValueError naming it. `copy_timeout=None` once launched a fleet whose every peer weight copy failed and
whose `shutdown()` raised TypeError, leaving the workers and their placement group running; a string timeout failed
inside Ray (OverflowError, TypeError) after Ray had started."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rollout.ray import RolloutFleet  # noqa: E402

CPU_WORKER = ["--device", "cpu", "--num-blocks", "64", "--log-level", "WARNING"]


@pytest.mark.parametrize(
    "name, value",
    [
        ("copy_timeout", None),
        ("copy_timeout", 0),
        ("placement_timeout", "60"),
        ("placement_timeout", -1),
        ("ready_timeout", "x"),
        ("ready_timeout", float("nan")),
        ("ready_timeout", True),
    ],
)
def test_a_timeout_that_is_not_a_positive_number_is_named_before_ray_starts(name, value):
    assert not ray.is_initialized()
    try:
        with pytest.raises(ValueError, match=f"{name}: a positive number of seconds"):
            RolloutFleet.launch(1, resources_per_worker={"CPU": 0.5}, worker_args=CPU_WORKER, **{name: value})
        assert not ray.is_initialized()  # found before Ray started anything
    finally:
        if ray.is_initialized():  # (a launch that went through: its fleet was dropped, Ray takes its workers down)
            ray.shutdown()


def test_resources_per_worker_that_is_not_a_dict_is_named():
    with pytest.raises(ValueError, match="resources_per_worker: a dict"):
        RolloutFleet.launch(1, resources_per_worker="CPU", worker_args=CPU_WORKER)
    assert not ray.is_initialized()

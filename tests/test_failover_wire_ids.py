"""A group resubmitted after a failover travels under a wire id of its own ("<group id>~retry<k>"): that id must
neither pass the worker's id limit nor be the id of another group of the same client."""

from __future__ import annotations

import signal

import pytest

from rollout.protocol.message_base import MAX_ID_LENGTH
from service_helpers import Worker
from trainer_bridge import GroupResult, PromptGroup, RolloutClient, RolloutError

pytestmark = pytest.mark.timeout(120)
SLOW = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 120}


def _moved_while_running(moved_id: str) -> list:
    """Two workers; group `moved_id` streams on the first, which is killed. Returns every event of the stream (a
    RolloutError ends it)."""
    first, second = Worker.several(2)
    try:
        with RolloutClient([first.address, second.address], timeout=30, heartbeat_s=0.2, dead_after_s=1.5) as client:
            assert len(client.stats()) == 2  # both answered: the group goes to the first (neither is busier)
            moved = client.stream(PromptGroup([1, 2, 3], sampling=SLOW, group_id=moved_id))
            events = [next(moved)]
            first.process.send_signal(signal.SIGKILL)
            try:
                events.extend(moved)
            except RolloutError as error:
                events.append(error)
            return events
    finally:
        first.close()
        second.close()


def _whole(events: list) -> GroupResult:
    assert isinstance(events[-1], GroupResult), events[-1]
    assert len(events[-1].completions[0].token_ids) == SLOW["max_new_tokens"], events[-1]
    return events[-1]


def test_a_moved_group_with_an_id_of_the_longest_length_is_served():
    """An id of MAX_ID_LENGTH characters is accepted, but "<id>~retry1" was past the worker's limit: the failover
    failed the call with bad_request instead of resubmitting it."""
    group_id = "x" * MAX_ID_LENGTH
    assert _whole(_moved_while_running(group_id)).group_id == group_id


def test_an_id_that_ends_like_a_resubmissions_is_refused_by_name():
    """A group "g" moved to the worker running the client's own group "g~retry1" was resubmitted under that group's
    id: the worker refused it (duplicate_group: "g" failed after its failover) and the client routed the refusal
    and then the other group's replies by that id, so "g~retry1" waited out its timeout. Such an id is refused when
    the group is made, and a resubmission's id is never one a caller may give."""
    from trainer_bridge.client.calls import checked_group, retry_wire_id

    with pytest.raises(RolloutError, match="must not end with '~retry' and a number") as refused:
        checked_group(PromptGroup([1, 2], group_id="g~retry1"), lambda: 1, lambda: "made")
    assert refused.value.code == "bad_request" and refused.value.field == "group_id"
    assert checked_group(PromptGroup([1, 2], group_id="g~retry"), lambda: 1, lambda: "made").group_id == "g~retry"
    assert retry_wire_id("g", 2) == "g~retry2"
    assert len(retry_wire_id("x" * MAX_ID_LENGTH, 10**6)) <= MAX_ID_LENGTH

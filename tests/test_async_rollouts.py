"""`AsyncRollouts`: prefetched rollouts with a staleness bound, against a real worker whose weights are pushed after
every step; the bound is checked on the policy version of every token trained on."""

from __future__ import annotations

import time

import pytest

from rollout.presets import tiny_model
from service_helpers import Worker
from trainer_bridge import PromptGroup, RolloutClient, RolloutError
from trainer_bridge.async_rollouts import AsyncRollouts
from trainer_bridge.weights.weight_sync import push_weights

GROUPS_PER_STEP = 3


@pytest.fixture(scope="module")
def worker():
    server = Worker()
    yield server
    server.close()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def client(worker, model):
    with RolloutClient(worker.address, timeout=60) as connection:
        push_weights(connection, model, version=connection.stats()[0]["policy_version"] + 1)  # a fresh baseline
        yield connection


def groups(count: int, seed: int = 0) -> list[PromptGroup]:
    sampling = {"max_new_tokens": 24, "stop_token_ids": [], "seed": seed}
    return [PromptGroup([5 + i, 6, 7, 8], n=2, sampling={**sampling, "seed": seed + i}) for i in range(count)]


def run(client, model, max_staleness: int, steps: int, push=None, **kwargs) -> list:
    """Train-loop stand-in: take `steps` batches, pushing weights after each (`version_after(step)`, or
    `push(step)` versions past the start, None: no push)."""
    batches = []
    prompts = groups(steps * GROUPS_PER_STEP + 2 * GROUPS_PER_STEP)
    with AsyncRollouts(client, prompts, GROUPS_PER_STEP, max_staleness, **kwargs) as rollouts:
        base = rollouts.base_version
        for batch in rollouts:
            batches.append((base, batch))
            version = rollouts.version_after(batch.step) if push is None else push(batch.step)
            if version is not None:
                push_weights(client, model, version=version if push is None else base + version)
            if batch.step + 1 == steps:
                break
    return batches


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_every_trained_token_is_within_the_staleness_bound(client, model, max_staleness):
    batches = run(client, model, max_staleness, steps=5)
    prompts = groups(5 * GROUPS_PER_STEP)
    for base, batch in batches:
        first = batch.step * GROUPS_PER_STEP
        assert [g.prompt_ids for g in batch.groups] == [p.prompt_ids for p in prompts[first : first + GROUPS_PER_STEP]]
        for group in batch.groups:
            for completion in group.completions:
                versions = [v for v, _ in completion.policy_versions] + [completion.kv_version_min]
                assert min(versions) - base >= batch.step - max_staleness, (batch.step, versions)
        assert all(0 <= lag <= max_staleness for lag in batch.lags) and len(batch.lags) == 2 * GROUPS_PER_STEP
        assert batch.regenerated == 0  # pushed every step: the window alone keeps samples fresh
    if max_staleness == 0:
        assert all(lag == 0 for _, batch in batches for lag in batch.lags)  # synchronous: on-policy


def test_stale_groups_are_regenerated_and_a_stalled_version_is_named(client, model):
    # No push after step 0, then a jump: step 2's prefetched groups (sampled at the baseline) are too old.
    batches = run(client, model, 1, steps=4, push=lambda step: {0: None, 1: 2, 2: 3, 3: 4}[step])
    assert sum(batch.regenerated for _, batch in batches) > 0
    assert all(lag <= 1 for _, batch in batches for lag in batch.lags)
    with pytest.raises(RolloutError, match="push weights with version=version_after"):
        run(client, model, 1, steps=4, push=lambda step: None)  # never pushed: would regenerate forever


def test_a_push_past_the_steps_version_is_refused_by_name(client, model):
    """A version pushed past version_after(step) would make every lag negative and the bound wrong: the next step
    says so, naming the version to push."""
    with pytest.raises(RolloutError, match="version .* was pushed, past step 1's weights") as refused:
        run(client, model, 1, steps=3, push=lambda step: 6)  # version_after(0) is base + 1
    assert (refused.value.code, refused.value.field) == ("version_mismatch", "version")


def test_workers_that_lost_the_push_end_the_rollouts_saying_what_to_do_next(worker, model):
    """The only worker restarted after step 0's push (as if: the client's newest push is one it does not serve).
    The groups of step 1 wait for a worker that serves it, then fail with "stale_workers", which says to push again:
    it now also says that these rollouts are closed, and with which base_version to start new ones."""
    with RolloutClient(worker.address, timeout=60, connect_timeout=1) as client:
        push_weights(client, model, version=client.stats()[0]["policy_version"] + 1)
        rollouts = AsyncRollouts(client, groups(4 * GROUPS_PER_STEP), GROUPS_PER_STEP, max_staleness=0)
        next(rollouts)
        client.min_policy_version = rollouts.version_after(0)  # pushed; the restarted worker serves the one before
        with pytest.raises(RolloutError) as ended:
            next(rollouts)
        assert ended.value.code == "stale_workers"
        assert "push the weights again" in str(ended.value)
        assert f"start new ones with base_version={rollouts.version_after(0)}" in str(ended.value)
        assert list(rollouts) == []  # closed


def test_closing_cancels_what_is_in_flight(client, worker):
    aborted_before = worker.stats()["samples_finished"].get("abort", 0)
    # The first step's groups are short, the prefetched ones long: those are still generating when the first
    # step's batch is taken, however many of them the worker's batch holds at once.
    prompts = [
        PromptGroup(group.prompt_ids, 2, {**group.sampling, "max_new_tokens": 8 if i < GROUPS_PER_STEP else 400})
        for i, group in enumerate(groups(30))
    ]
    rollouts = AsyncRollouts(client, prompts, GROUPS_PER_STEP, max_staleness=3)
    next(rollouts)
    deadline = time.monotonic() + 20
    while not worker.stats()["running"] and time.monotonic() < deadline:  # a slow machine: the prefetch arrives
        time.sleep(0.01)
    rollouts.close()
    assert list(rollouts) == []
    deadline = time.monotonic() + 20
    while (stats := worker.stats())["groups_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (stats["groups_in_flight"], stats["running"]) == (0, 0)  # the prefetched groups were cancelled
    assert stats["samples_finished"]["abort"] > aborted_before
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncRollouts(client, [], GROUPS_PER_STEP, max_staleness=-1)


def straggling_groups(count: int) -> list[PromptGroup]:
    """Every third group is a straggler: 48 tokens against 6 (no stop token: each runs to its length)."""
    return [
        PromptGroup([5 + i, 6, 7, 8], n=2, sampling={"max_new_tokens": 48 if i % 3 == 0 else 6, "stop_token_ids": [],
                                                     "seed": 100 + i})
        for i in range(count)
    ]  # fmt: skip


def test_partial_rollouts_train_complete_groups_and_carry_stragglers(client, model):
    """Each step takes the first complete groups; stragglers keep generating (mode "keep", the same weights pushed
    every step) and join the next step. Every group is trained once, its tokens within the version bound, and a
    group carried across steps has exactly the tokens of the same group generated alone."""
    prompts = straggling_groups(18)
    trained, carried = [], 0
    with AsyncRollouts(client, prompts, GROUPS_PER_STEP, max_staleness=1, partial_rollouts=True) as rollouts:
        base = rollouts.base_version
        for batch in rollouts:
            assert len(batch.groups) == GROUPS_PER_STEP and all(0 <= lag <= 1 for lag in batch.lags), batch.lags
            for group in batch.groups:
                for completion in group.completions:
                    versions = [v for v, _ in completion.policy_versions] + [completion.kv_version_min]
                    assert min(versions) - base >= batch.step - 1
            trained += batch.groups
            carried += batch.carried_over
            push_weights(client, model, version=rollouts.version_after(batch.step))  # unchanged weights
            if batch.step == 3:
                break
    assert len({g.group_id for g in trained}) == len(trained) == 4 * GROUPS_PER_STEP  # each trained once
    assert carried >= 2  # the first step's stragglers joined the second
    by_prompt = {tuple(p.prompt_ids): p for p in prompts}
    long_ones = [g for g in trained if len(g.completions[0].token_ids) == 48]
    assert long_ones
    alone = client.generate_many([PromptGroup(list(g.prompt_ids), 2, dict(by_prompt[tuple(g.prompt_ids)].sampling))
                                  for g in long_ones])  # fmt: skip
    for carried_group, reference in zip(long_ones, alone):
        assert [c.token_ids for c in carried_group.completions] == [c.token_ids for c in reference.completions]


def test_partial_rollouts_settings_are_refused_by_name(client):
    with pytest.raises(ValueError, match="max_partial_rounds=2 .* beyond max_staleness=0"):
        AsyncRollouts(client, [], GROUPS_PER_STEP, partial_rollouts=True)
    with pytest.raises(ValueError, match="max_partial_rounds has no effect without partial_rollouts"):
        AsyncRollouts(client, [], GROUPS_PER_STEP, max_staleness=1, max_partial_rounds=2)
    with pytest.raises(ValueError, match="max_partial_rounds must be an integer >= 2"):
        AsyncRollouts(client, [], GROUPS_PER_STEP, max_staleness=1, partial_rollouts=True, max_partial_rounds=1)
    with pytest.raises(ValueError, match="partial_overprovision must be"):
        AsyncRollouts(client, [], GROUPS_PER_STEP, max_staleness=1, partial_rollouts=True, partial_overprovision=2)


def test_one_staleness_rule_for_every_mode():
    """The gate every mode shares (AsyncRollouts, its partial rollouts, TRL's async and partial modes): a group older
    than allowed is generated again once under "regenerate", kept under "is_correct", and a group still too old after
    being generated again is an error naming the versions, never another round."""
    from rollout.protocol import Completion, GroupResult
    from trainer_bridge.staleness import StalenessGate

    def result(version: int) -> GroupResult:
        completion = Completion(
            0, [5, 6], [-0.1, -0.2], "length", policy_versions=[[version, 0]], kv_version_min=version
        )
        return GroupResult("g", [1, 2], [completion])

    gate = StalenessGate(oldest_allowed=3, stale_policy="regenerate", hint=" (hint)")
    assert not gate.must_regenerate("fresh", result(3))
    assert gate.must_regenerate("old", result(2)) and gate.regenerated == {"old"}
    with pytest.raises(RolloutError, match=r"older than version 3 \(the workers serve version 2\).*\(hint\)"):
        gate.must_regenerate("old", result(2))
    kept = StalenessGate(oldest_allowed=3, stale_policy="is_correct")
    assert not kept.must_regenerate("old", result(0)) and not kept.regenerated


def test_group_ids_that_come_again_each_epoch_keep_their_own_results(client, model, worker):
    """A stable id per prompt, repeated each epoch: the client takes an id again once its group finished. A straggler
    that finishes while the trainer trains keeps its result (the next epoch's group of its id does not take it), and
    every group is trained once, none waited for in vain."""
    lengths = [150, 4, 4, 4]  # prompt-0 straggles
    prompts = [
        PromptGroup([5 + i, 6, 7], n=2, group_id=f"prompt-{i}",
                    sampling={"max_new_tokens": n, "stop_token_ids": [], "seed": i})
        for _ in range(3) for i, n in enumerate(lengths)
    ]  # fmt: skip
    trained = []
    with AsyncRollouts(client, prompts, 2, max_staleness=1, partial_rollouts=True, timeout=20) as rollouts:
        for batch in rollouts:
            trained += [(g.group_id, len(g.completions[0].token_ids)) for g in batch.groups]
            push_weights(client, model, version=rollouts.version_after(batch.step))
            deadline = time.monotonic() + 20
            while worker.stats()["running"] and time.monotonic() < deadline:  # the straggler finishes meanwhile
                time.sleep(0.05)
    assert sorted(trained) == sorted((f"prompt-{i}", n) for _ in range(3) for i, n in enumerate(lengths))


def test_the_default_base_version_is_what_every_group_is_sampled_with(worker, model):
    """base_version defaults to the newest version a worker serves: the client then sends groups only to workers that
    serve it, never to one behind it (restarted, or pushed to through another client): with max_staleness=0 nothing
    is stale, nothing generated again."""
    behind = Worker()
    try:
        with RolloutClient(worker.address, timeout=60) as ahead:
            push_weights(ahead, model, version=ahead.stats()[0]["policy_version"] + 5)
        with RolloutClient([worker.address, behind.address], timeout=60) as both:
            assert len(both.stats()) == 2
            with AsyncRollouts(both, groups(8), 8, max_staleness=0) as rollouts:  # spread over both workers
                batch = next(rollouts)
            assert batch.lags == [0] * 16 and batch.regenerated == 0
    finally:
        behind.close()

"""`AsyncRollouts`: asynchronous off-policy rollouts for a plain training loop, and its `RolloutBatch`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from rollout.validation import is_seconds
from trainer_bridge.client.calls import (
    GroupResult,
    PromptGroup,
    RolloutError,
    sample_oldest_version,
)
from trainer_bridge.partial_rounds import PartialRounds, check_partial
from trainer_bridge.slots_in_flight import SlotsInFlight
from trainer_bridge.staleness import STALE_POLICIES, StalenessGate

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """One training step's groups.

    Attributes:
        step: the step it is for (0, 1, ...).
        groups: its GroupResults, in the order their prompts came.
        lags: per sample, `step` minus the oldest weights' version behind it (0: on-policy).
        regenerated: groups generated again because they were too stale.
        wait_s: seconds the caller waited for this batch.
        carried_over: with partial rollouts, groups sent in an earlier step (they spanned more than one).
    """

    step: int
    groups: list[GroupResult]
    lags: list[int] = field(default_factory=list)
    regenerated: int = 0
    wait_s: float = 0.0
    carried_over: int = 0


class AsyncRollouts:
    """Asynchronous off-policy rollouts for a plain training loop. Groups for the next `max_staleness` steps are
    generated while the trainer trains on this one; a sample is trained on only if the weights that produced it are at
    most `max_staleness` steps old.

    ```python
    with AsyncRollouts(client, groups, groups_per_step=16, max_staleness=2) as rollouts:
        for batch in rollouts:                             # batch.groups: this step's GroupResults
            loss(batch.groups).backward(); optimizer.step()
            push_weights(client, model, version=rollouts.version_after(batch.step))  # mode "keep"
            if batch.step + 1 == num_steps:
                break
    ```

    The staleness rule: step `s` trains weights of version `base_version + s` (`base_version`: what the workers serve
    when the rollouts start; push `version_after(s) = base_version + s + 1` after step `s`, as above); a group is fresh
    for step `s` when the oldest weights behind any of its samples (the version that sampled its first token, or that
    computed its prompt's KV if older) are at least `base_version + s - max_staleness`. With `stale_policy="regenerate"`
    (the default) a stale group is generated again (same prompt, same seed) until it is fresh; with `"is_correct"` it is
    kept as it is (its logprobs are the behaviour policy's, so an importance-sampling correction stays exact). Groups
    are taken from `groups` in order and step `s` always trains on groups `s * groups_per_step` to
    `(s + 1) * groups_per_step - 1`, however they finish, so a run is reproducible in which prompts each step sees;
    groups left over at the end that do not fill a step are not trained on (a logged warning says how many).
    `max_staleness=0` is synchronous: the next step's groups are sent only when it asks.

    With `partial_rollouts=True` (`trainer_bridge.partial_rounds`), a step trains the first complete groups instead:
    `groups_per_step` plus `partial_overprovision` of it more are kept in flight, a step takes the oldest complete ones
    (and waits for any that already spanned `max_partial_rounds` steps), and the rest keep generating into later steps.
    Steps then no longer see the prompts in order; `batch.carried_over` counts the groups sent in an earlier step.
    `max_staleness` must cover `max_partial_rounds - 1` (refused by name otherwise).
    """

    def __init__(
        self,
        client: Any,
        groups: Iterable[PromptGroup],
        groups_per_step: int,
        max_staleness: int = 0,
        stale_policy: str = "regenerate",
        timeout: float | None = None,
        base_version: int | None = None,
        partial_rollouts: bool = False,
        max_partial_rounds: int | None = None,
        partial_overprovision: float | None = None,
    ):
        """
        Args:
            client: a `RolloutClient`.
            groups: the prompt groups, in training order (an iterator is read as far ahead as the window needs).
            groups_per_step: groups per training batch.
            max_staleness: how many optimizer steps older than the current one a sample's weights may be (0:
                synchronous; k: the next k steps' groups are generated while this one trains).
            stale_policy: "regenerate" (stale groups are generated again) or "is_correct" (kept as they are).
            timeout: most seconds to wait for one group (default: the client's).
            base_version: the version of step 0's weights (default: the newest version the client's workers serve
                now; the client routes groups only to workers that serve it).
            partial_rollouts: a step trains the first complete groups; unfinished ones join later steps.
            max_partial_rounds: with partial_rollouts, most steps one group may span (default 2).
            partial_overprovision: with partial_rollouts, extra groups in flight as a fraction of groups_per_step,
                in (0, 1] (default 0.5).
        Raises:
            ValueError: a bad setting, naming it.
        """
        if not isinstance(groups_per_step, int) or isinstance(groups_per_step, bool) or groups_per_step < 1:
            raise ValueError(f"groups_per_step must be an integer >= 1, got {groups_per_step!r}")
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
        if timeout is not None and not is_seconds(timeout):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if base_version is not None and (not isinstance(base_version, int) or isinstance(base_version, bool)):
            raise ValueError(f"base_version must be an integer (a policy version), got {base_version!r}")
        check_partial(partial_rollouts, max_partial_rounds, partial_overprovision, max_staleness, 1)
        self.partial: PartialRounds | None = None
        if partial_rollouts:
            self.partial = PartialRounds(groups_per_step)
            self.partial.max_partial_rounds = max_partial_rounds or self.partial.max_partial_rounds
            self.partial.overprovision = partial_overprovision or self.partial.overprovision
        self.client = client
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.timeout = client.timeout if timeout is None else timeout
        self.step = 0  # the step the next batch is for
        if base_version is None:
            try:
                base_version = max(stats["policy_version"] for stats in client.stats())
            except RolloutError as error:
                message = f"could not read base_version from the rollout workers ({error}); give base_version"
                raise RolloutError("no_workers", message) from error
            # Step 0's weights: the client routes groups only to workers that serve them (not to one that restarted,
            # or missed a push through another client, whose older weights every group would be too stale on).
            client.min_policy_version = max(client.min_policy_version, base_version)
        self.base_version = base_version
        self._flight = SlotsInFlight(client, groups, self.timeout)  # the groups of the steps not yielded yet
        self._results: dict[int, GroupResult] = {}
        self._closed = False

    def __iter__(self) -> AsyncRollouts:
        return self

    def __next__(self) -> RolloutBatch:
        """The next step's batch: waits for its groups (regenerating stale ones) while later steps' groups run.

        Raises:
            StopIteration: the groups ran out before a whole batch (groups left over that do not fill one are not
                trained on: a warning names how many).
            RolloutError: a group failed or timed out (naming why); the rollouts are closed then.
        """
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        if self.partial is not None:
            return self._next_partial(started)
        try:
            self._fill_window()
            first = self.step * self.groups_per_step
            wanted = range(first, first + self.groups_per_step)
            if wanted.stop > self._flight.num_taken:
                self._end_short(self._flight.num_taken - first)
            gate = self._staleness_gate()
            while True:
                self._collect_until(wanted)
                stale = [i for i in wanted if gate.must_regenerate(i, self._results[i])]
                if not stale:
                    break
                for index in stale:  # generated again under newer weights, in the same slot (same prompt and seed)
                    del self._results[index]
                    self._flight.send(index)
        except BaseException as error:
            self._close_after(error)
        groups = [self._results.pop(i) for i in wanted]
        for index in wanted:
            self._flight.forget(index)
        now = self.base_version + self.step
        lags = [now - sample_oldest_version(c) for g in groups for c in g.completions]
        batch = RolloutBatch(self.step, groups, lags, len(gate.regenerated), time.perf_counter() - started)
        self.step += 1
        return batch

    def _staleness_gate(self) -> StalenessGate:
        """This step's check of its groups' age (refused when this client pushed a version past the step's: every
        lag and the staleness bound would be off by the difference)."""
        hint = f" (step {self.step}): push weights with version=version_after(step) after each optimizer step"
        pushed, now = self.client.min_policy_version, self.base_version + self.step
        if pushed > now:
            reason = f"version {pushed} was pushed, past step {self.step}'s weights (version {now}){hint}"
            raise RolloutError("version_mismatch", reason, "version")
        return StalenessGate(self.base_version + self.step - self.max_staleness, self.stale_policy, hint)

    def version_after(self, step: int) -> int:
        """The policy version to push after training on step `step`'s batch."""
        return self.base_version + step + 1

    def _close_after(self, error: BaseException) -> NoReturn:
        """Close (an error ends the rollouts), then raise `error`; one that says to push the weights again says
        what to do after it too, since these rollouts cannot go on."""
        self.close()
        if isinstance(error, RolloutError) and error.code == "stale_workers":
            message = (
                f"{str(error).removeprefix('stale_workers: ')} These AsyncRollouts are closed (their groups in flight "
                f"cancelled): after the push, start new ones with base_version={self.base_version + self.step}."
            )
            raise RolloutError(error.code, message, error.field) from error
        try:
            raise error
        finally:  # the traceback keeps this frame, not the error: no cycle to collect
            error = None

    def close(self) -> None:
        """Cancel every group still in flight (also at the end of a `with` block, and on errors)."""
        if self._closed:
            return
        self._closed = True
        self._flight.cancel_running()

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------------------------
    def _next_partial(self, started: float) -> RolloutBatch:
        """The next step's batch with partial rollouts: top the pool up, then wait until it can give a step."""
        pool = self.partial
        assert pool is not None
        try:
            while pool.room and (index := self._flight.send_next()) is not None:  # new groups, sent in this step
                pool.add(index, self.step)
            if len(pool) < self.groups_per_step:
                self._end_short(len(pool))
            gate = self._staleness_gate()
            while True:
                for index, result in pool.completed():
                    if gate.must_regenerate(index, result):
                        self._flight.send(index)
                        pool.resent(index, self.step)
                taken = pool.take(self.step)
                if taken is not None:
                    break
                self._collect_one()
        except BaseException as error:
            self._close_after(error)
        carried = sum(1 for _, _, round_sent in taken if round_sent < self.step)
        for index, _, _ in taken:
            self._flight.forget(index)
        groups = [result for _, result, _ in taken]
        now = self.base_version + self.step
        lags = [now - sample_oldest_version(c) for g in groups for c in g.completions]
        batch = RolloutBatch(self.step, groups, lags, len(gate.regenerated), time.perf_counter() - started, carried)
        self.step += 1
        return batch

    def _end_short(self, left: int) -> None:
        """End the iteration: the groups ran out before a whole step. Its `left` groups are not trained on (every step
        has groups_per_step groups, as trainers expect): said in a warning, never dropped silently.

        Args:
            left: groups taken for the unfinished step (sent, maybe finished: cancelled now).
        Raises:
            StopIteration: always.
        """
        if left:
            logger.warning(
                "AsyncRollouts: the last %d prompt group(s) do not fill a step of groups_per_step=%d and are dropped "
                "untrained (after %d steps); give a multiple of groups_per_step to train on every prompt",
                left,
                self.groups_per_step,
                self.step,
            )
        self.close()
        raise StopIteration

    def _next_result(self) -> tuple[int, GroupResult] | None:
        """Wait for one result of a group in flight: (its slot, the result), or None when it was aborted (a weight
        update in mode "abort": sent again here) or its slot is gone.

        Raises:
            RolloutError: a timeout, the client's error, or a sample that failed on its worker.
        """
        answer = self._flight.next_result()
        if answer is None or (self.partial is not None and answer[0] not in self.partial):
            return None
        index, event = answer
        if any(c.finish_reason == "error" for c in event.completions):
            error = next(c.error for c in event.completions if c.finish_reason == "error")
            raise RolloutError("error", f"group {event.group_id} failed on its worker: {error}")
        if any(c.finish_reason == "abort" for c in event.completions):
            self._flight.send(index)
            if self.partial is not None:
                self.partial.resent(index, self.step)
            return None
        return index, event

    def _collect_one(self) -> None:
        """Partial rollouts: wait for one result and complete its slot."""
        if (result := self._next_result()) is not None:
            self.partial.complete(*result)

    def _fill_window(self) -> None:
        """Submit groups up to the end of step `step + max_staleness` (the window of steps allowed in flight)."""
        end = (self.step + self.max_staleness + 1) * self.groups_per_step
        while self._flight.num_taken < end and self._flight.send_next() is not None:
            pass

    def _collect_until(self, wanted: range) -> None:
        while any(i not in self._results for i in wanted):
            if (result := self._next_result()) is not None:
                index, event = result
                self._results[index] = event

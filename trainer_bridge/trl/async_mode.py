"""Asynchronous off-policy GRPO for `RolloutGRPOTrainer(..., max_staleness=k)` ("server" mode): the rows of the next
`k` generation rounds are taken from the trainer's own dataloader ahead of time (same sampler, same order, same
per-rank split: the dataloader is only read ahead, never reordered), tokenized by the trainer's own
`_tokenize_prompts`, and sent to the workers while the trainer trains on the current round. Weights are still pushed
at every step (TRL's `sync_weights`, mode "keep" by default): samples in flight continue under the new weights and
their per-token versions say so.

How far ahead: a round spans `steps_per_generation * num_iterations / gradient_accumulation_steps` optimizer steps, so
`k` steps allow `k * gradient_accumulation_steps // (steps_per_generation * num_iterations)` rounds ahead (at least
one, else the trainer is refused at construction); round j after the current one generates from batch `p + j *
steps_per_generation * num_iterations` of the epoch's stream, `p` being the current round's; a round that would start
at or past `max_steps` is not sent. When TRL asks for a training round's completions, the round sent ahead for the
same batch of the stream is used, if its rows are the ones TRL asks for (an evaluation round is generated when asked,
with the weights as they are; rounds of equal rows are each sent ahead, for their own batch); a group whose oldest
weights (the version of its first token, or of its KV if older) are older than `global_step - k` at the step the
round is generated for is generated again (`stale_policy="regenerate"`) or kept (`"is_correct"`: its logprobs are the
behaviour policy's, so TRL's importance-sampling correction, `vllm_importance_sampling_correction=True`, which it
needs, weighs it; exactly so where TRL's ratio is not truncated or capped). The first round of each epoch is
generated on demand. Logged per round: `rollout/stale_regenerated`, `rollout/wait_s` (the trainer's wait for the
round), `rollout/worker_idle_s` (how long the workers' engines had nothing to run since the last round, summed over
the workers) and the policy lag (`rollout/policy_lag_mean`, `_max`, and `rollout/policy_lag_<i>`: the fraction of
tokens `i` steps old, for i < `LAG_BUCKETS`, then `rollout/policy_lag_<LAG_BUCKETS>+`). `close()` (at the end of
`train()`, on errors and KeyboardInterrupt) cancels what was sent ahead.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainer_bridge.client import GroupResult, PromptGroup, RolloutError
from trainer_bridge.client.calls import timed_out
from trainer_bridge.staleness import StalenessGate
from trainer_bridge.trl.generation import RolloutGeneration
from trainer_bridge.trl.restarted_workers import push_again, why_not_again

logger = logging.getLogger("trainer_bridge.trl")

# How often a wait for results checks for live workers that all restarted since the step's push (`_next_event`).
RESTART_POLL_S = 0.25
KEPT_YIELDED = 256  # yielded batches a Lookahead keeps (a trainer takes at most its gradient accumulation ahead)
# `rollout/policy_lag_<i>` is logged for i below this; with a larger max_staleness, tokens at least this many steps
# old are logged together as `rollout/policy_lag_<LAG_BUCKETS>+` (one metric per possible lag would be thousands).
LAG_BUCKETS = 8
_END = object()
RoundRows = tuple[tuple[tuple[int, ...], int], ...]  # (prompt ids, n) of each group of a round
# A round sent ahead: the index of its batch in the epoch's stream, and its rows. Rows alone would send two upcoming
# rounds of equal rows (a small dataset, repeated prompts) as one, the second only a round later.
RoundKey = tuple[int, RoundRows]


class Lookahead:
    """An iterator over a dataloader's batches that can also read ahead without changing what it yields; batches are
    addressed by their index in this iterator (the epoch's stream)."""

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator
        self._batches: dict[int, Any] = {}  # read, by index: those not yielded yet and a few yielded ones
        self._read = 0  # batches taken from the underlying iterator
        self.yielded = 0  # batches handed to the trainer

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self.yielded == self._read:
            self._read_one()
        batch = self._batches.get(self.yielded, _END)
        if batch is _END:
            raise StopIteration
        self.yielded += 1
        for old in [index for index in self._batches if index < self.yielded - KEPT_YIELDED]:
            del self._batches[old]  # the trainer may still be on a batch it took a few ahead (gradient accumulation)
        return batch

    def at(self, index: int) -> Any:
        """The batch at `index` of the stream (reading ahead as needed), or None past its end or long yielded."""
        while self._read <= index and self._read_one():
            pass
        batch = self._batches.get(index, _END)
        return None if batch is _END else batch

    def _read_one(self) -> bool:
        try:
            self._batches[self._read] = next(self._iterator)
        except StopIteration:
            return False
        self._read += 1
        return True


class LookaheadLoader:
    """The trainer's train dataloader, whose iterators are `Lookahead`s handed to `on_iter`; everything else (len,
    set_epoch, batch_size, ...) is the dataloader's own."""

    def __init__(self, loader: Any, on_iter: Callable[[Lookahead], None]):
        self._loader = loader
        self._on_iter = on_iter

    def __iter__(self) -> Lookahead:
        iterator = Lookahead(iter(self._loader))
        self._on_iter(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class AsyncRolloutGeneration(RolloutGeneration):
    """`RolloutGeneration` that sends the next rounds ahead and keeps their samples within a staleness bound."""

    def __init__(self, *args: Any, max_staleness: int, stale_policy: str = "regenerate", **kwargs: Any):
        """
        Args:
            *args, **kwargs: `RolloutGeneration`'s.
            max_staleness: rounds sent ahead, and how many steps old a sample's weights may be (>= 1).
            stale_policy: "regenerate" or "is_correct".
        """
        super().__init__(*args, **kwargs)
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        config = self.trainer.args
        # Batches per generation round (TRL generates from every `every`-th batch of the stream, and trains on it
        # `every` micro-steps), and the optimizer steps one round spans: rounds sent ahead must stay within k steps.
        self.every = config.steps_per_generation * self.trainer.num_iterations
        self.rounds_ahead = max_staleness * config.gradient_accumulation_steps // self.every
        if self.rounds_ahead < 1:
            raise ValueError(
                f"max_staleness={max_staleness} is less than the optimizer steps one generation round spans "
                f"(steps_per_generation * num_iterations / gradient_accumulation_steps = "
                f"{self.every / config.gradient_accumulation_steps:g}): raise it"
            )
        self.lookahead: Lookahead | None = None  # the train dataloader's current iterator (see `start_epoch`)
        self._epoch_start_step = 0  # the trainer's micro-step count when that iterator began
        self._sink: queue.SimpleQueue = queue.SimpleQueue()
        self._ahead: dict[RoundKey, list[PromptGroup]] = {}  # rounds sent ahead, by their batch and rows
        self._results: dict[str, GroupResult] = {}
        self._in_flight: set[str] = set()
        self.num_unmatched_rounds = 0  # training rounds TRL asked for that were not sent ahead (generated then)
        self._idle_s: dict[str, float] = {}  # each worker's idle seconds at the last round

    def _generate_groups(self, groups: list[PromptGroup]) -> Iterable[GroupResult]:
        started = time.perf_counter()
        training = self.trainer.model.training
        # An evaluation round samples the policy as it is now, never a training round's rows sent ahead.
        sent = self._ahead.pop((self._stream_index(), _rows(groups)), None) if training else None
        if sent is None:
            self.num_unmatched_rounds += int(training)
            sent = [self._send(group) for group in groups]
        if training:
            self._send_ahead()  # the next rounds run while this one is waited for and trained on
        gate = StalenessGate(self.base_version + self.trainer.state.global_step - self.max_staleness, self.stale_policy)
        while True:
            results = self._wait([g.group_id for g in sent])
            stale = [i for i, result in enumerate(results) if gate.must_regenerate(i, result)]
            if not stale:
                break
            for i in stale:
                sent[i] = self._send(sent[i])
        waited = time.perf_counter() - started
        self._log({"rollout/stale_regenerated": float(len(gate.regenerated)), "rollout/wait_s": waited})
        self._log_worker_idle()
        return [dataclasses.replace(result, group_id=group.group_id) for result, group in zip(results, groups)]

    def start_epoch(self, iterator: Lookahead) -> None:
        """The trainer began iterating its dataloader (an epoch): read ahead from this iterator."""
        self._cancel_ahead(lambda index: True)  # an earlier epoch's: their batch indexes count from its start
        self.lookahead = iterator
        self._epoch_start_step = self.trainer._step  # noqa: SLF001 - TRL's micro-step count

    def _stream_index(self) -> int:
        """The index in the epoch's stream of the batch the current round generates from (the trainer's micro-steps
        since the epoch began)."""
        return self.trainer._step - self._epoch_start_step  # noqa: SLF001 - TRL's micro-step count

    def _cancel_ahead(self, gone: Callable[[int], bool]) -> None:
        """Cancel the rounds sent ahead for the batches `gone(index)` says no round will ask for any more."""
        for key in [key for key in self._ahead if gone(key[0])]:
            for group in self._ahead.pop(key):
                if group.group_id in self._in_flight:
                    self._in_flight.discard(group.group_id)
                    self.client.cancel(group.group_id)
                self._results.pop(group.group_id, None)

    def close(self) -> None:
        """Cancel every group sent ahead and still in flight, and forget the dataloader's iterator."""
        for group_id in list(self._in_flight):
            self.client.cancel(group_id)
        self._in_flight.clear()
        self._ahead.clear()
        self._results.clear()
        self.lookahead = None
        while not self._sink.empty():  # the cancelled groups' results, arriving late, are nobody's
            self._sink.get_nowait()

    def _send_ahead(self) -> None:
        """Send the rows of the next rounds (as many as stay within max_staleness optimizer steps) not sent yet,
        read ahead from the dataloader: the current round generates from batch p of the epoch's stream (p: the
        trainer's micro-steps since the epoch began), round j after it from batch p + j * every."""
        if self.lookahead is None or self.trainer.environment_factories is not None:
            return  # environments: their reset() at the round writes its prompts (`check_tool_loop` warned)
        state, accumulation = self.trainer.state, self.trainer.args.gradient_accumulation_steps
        current = self._stream_index()
        self._cancel_ahead(lambda index: index <= current)  # sent for a batch whose round has come: not its rows
        for ahead in range(1, self.rounds_ahead + 1):
            if 0 < state.max_steps <= state.global_step + ahead * self.every // accumulation:
                return  # a round no step of this run trains: nothing would take it
            index = current + ahead * self.every
            if any(key[0] == index for key in self._ahead):
                continue  # sent at an earlier round
            batch = self.lookahead.at(index)
            if batch is None:
                return
            prompts = [row["prompt"] for row in batch]
            prompt_ids, _, _ = self.trainer._tokenize_prompts(copy.deepcopy(prompts))  # noqa: SLF001 - TRL's own
            groups = self._groups(prompt_ids)
            self._ahead[(index, _rows(groups))] = [self._send(group) for group in groups]

    def _groups(self, prompt_ids: list[list[int]]) -> list[PromptGroup]:
        """Consecutive equal rows as one group of n, as `generate_rows` makes them."""
        groups: list[PromptGroup] = []
        for row in prompt_ids:
            if groups and groups[-1].prompt_ids == list(row):
                groups[-1].n += 1
            else:
                groups.append(PromptGroup(list(row), 1, self.seeded(self.settings_for(list(row), self.sampling))))
        return groups

    def _send(self, group: PromptGroup) -> PromptGroup:
        call = self.client._submit(group, stream=False, sink=self._sink)  # noqa: SLF001 - same package
        self._in_flight.add(call.group.group_id)
        return call.group

    def _wait(self, group_ids: list[str]) -> list[GroupResult]:
        while any(group_id not in self._results for group_id in group_ids):
            event = self._next_event(self._sink)
            if isinstance(event, RolloutError):
                try:
                    raise event
                finally:  # the traceback keeps this frame, not the error: no cycle to collect
                    event = None
            if event.group_id not in self._in_flight:
                continue  # a cancelled round's group (`_cancel_ahead`), its abort arriving late: nobody asks for it
            self._in_flight.discard(event.group_id)
            self._results[event.group_id] = event
        return [self._results.pop(group_id) for group_id in group_ids]

    def _next_event(self, sink: queue.SimpleQueue) -> Any:
        """The next event of `sink` (a result or an error), waited for up to the client's timeout.

        Meanwhile, when every live worker serves weights older than the step's push (the only workers restarted
        since, with their starting weights), the client gives them none of the round's groups, and the next push,
        which would bring them up to date, comes only after the round: the step's weights are pushed to them
        again, at the same version (as `restarted_workers` does for a synchronous round), and the round goes on.

        Raises:
            RolloutError: ("timeout") nothing came in time, naming why no worker serves.
        """
        deadline = time.monotonic() + self.client.timeout
        while True:
            try:
                return sink.get(timeout=max(0.0, min(RESTART_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    message = f"no group finished within {self.client.timeout:g} s"
                    raise timed_out(message, self.client.outage()) from None
            self._push_to_restarted_workers()

    def _push_to_restarted_workers(self) -> None:
        """Push the step's weights again when the client's live workers all serve older ones (see `_next_event`); a
        sharded model on several ranks cannot be pushed by one: its calls fail with "stale_workers" then."""
        client = self.client
        if self.last_version is None or not hasattr(client, "live_workers") or not client.live_workers():
            return
        if getattr(client, "updating", False) or client.outage() is None or why_not_again(self, False) is not None:
            return  # a worker serves the step's weights (or a push is under way, or none can be made here)
        step = self.trainer.state.global_step
        logger.warning(
            "%s: pushing step %d's weights to them again, at version %d", client.outage(), step, self.last_version
        )
        push_again(self, self.last_version)

    def _log_worker_idle(self) -> None:
        """`rollout/worker_idle_s`: seconds the workers' engines sat idle since the last round (summed over them)."""
        try:
            now = {stats["address"]: stats.get("idle_s", 0.0) for stats in self.client.stats(timeout=5)}
        except RolloutError:  # a worker did not answer in time: no figure this round
            return
        if self._idle_s:  # workers seen last round only (one that just came back has no delta yet)
            self._log({"rollout/worker_idle_s": sum(now[a] - self._idle_s[a] for a in now if a in self._idle_s)})
        self._idle_s = now

    def _log(self, values: dict[str, float]) -> None:
        mode = "train" if self.trainer.model.training else "eval"
        for name, value in values.items():
            self.trainer._metrics[mode][name].append(value)  # noqa: SLF001 - TRL's metric store

    def _log_lag(self, row_lags: list[list[int]]) -> None:
        super()._log_lag(row_lags)
        # The oldest lag a token may have: max_staleness, unless "is_correct" keeps older groups (every bucket then,
        # the same ones each round: a metric logged in some rounds only would be averaged over those alone).
        oldest = self.max_staleness if self.stale_policy == "regenerate" else LAG_BUCKETS
        names = [f"rollout/policy_lag_{lag}" for lag in range(min(oldest + 1, LAG_BUCKETS))]
        if oldest >= LAG_BUCKETS:
            names.append(f"rollout/policy_lag_{LAG_BUCKETS}+")
        counts, total = [0] * len(names), 0
        for lag in (lag for row in row_lags for lag in row):
            if 0 <= lag < LAG_BUCKETS and lag <= oldest:
                counts[lag] += 1
            elif lag >= LAG_BUCKETS and oldest >= LAG_BUCKETS:
                counts[-1] += 1
            total += 1
        if total:
            self._log({name: count / total for name, count in zip(names, counts)})


def _rows(groups: list[PromptGroup]) -> RoundRows:
    return tuple((tuple(group.prompt_ids), group.n) for group in groups)

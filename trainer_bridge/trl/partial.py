"""Partial rollouts for `RolloutGRPOTrainer(..., partial_rollouts=True)` ("server" mode): a generation round trains
the first complete groups instead of waiting for its slowest sample (APRIL, slime; `trainer_bridge.partial_rounds`).

The rows come from the trainer's own dataloader, read ahead as in `trainer_bridge.trl.async_mode` (same sampler, same
order, same per-rank split). Each round keeps `groups + ceil(partial_overprovision * groups)` GRPO groups in flight:
the round's own rows, then the next rounds' rows in stream order. It takes the oldest complete groups (and waits for
any that already spanned `max_partial_rounds` rounds), and hands TRL those rows, with their dataset columns, in
place of the rows the dataloader gave for the round: rewards, advantages and the loss see whole groups with their
own columns. The other groups keep generating on the workers (push mode "keep": their KV stays, every token is
tagged with its weights' version) and join a later round, so TRL's importance-sampling correction
(`vllm_importance_sampling_correction`) sees each token's true behaviour policy. Every row of the stream is trained
once, in the round its group completes; rows still in flight when `train()` ends are cancelled, never trained.

Weights are pushed at the start of each round (TRL's own rule: when the global step changed), before the round's new
groups are sent. Logged per round: `rollout/partial_carried_over` (groups sent in an earlier round) and
`rollout/wait_s`, with the policy-lag metrics of `trainer_bridge.trl.async_mode`. Evaluation rounds generate their own
rows, as without partial rollouts.
"""

from __future__ import annotations

import copy
import queue
import time
from typing import Any

from trainer_bridge.client import PromptGroup, RolloutError
from trainer_bridge.partial_rounds import PartialRounds
from trainer_bridge.staleness import StalenessGate
from trainer_bridge.trl.async_mode import AsyncRolloutGeneration
from trainer_bridge.trl.generation import RolloutRows
from trainer_bridge.trl.old_logps import SampledRound

GroupKey = tuple[int, int, int]  # (epoch, index of its batch in the epoch's stream, index of the group in the batch)


class PartialRolloutGeneration(AsyncRolloutGeneration):
    """`AsyncRolloutGeneration` whose training rounds take the first complete groups; see the module docstring."""

    def __init__(self, *args: Any, max_partial_rounds: int, partial_overprovision: float, **kwargs: Any):
        """
        Args:
            *args, **kwargs: `AsyncRolloutGeneration`'s (max_staleness covers max_partial_rounds - 1 rounds).
            max_partial_rounds: most generation rounds one group may span.
            partial_overprovision: extra groups in flight, as a fraction of a round's groups, in (0, 1].
        """
        super().__init__(*args, **kwargs)
        self.max_partial_rounds = max_partial_rounds
        self.partial_overprovision = partial_overprovision
        self.pool: PartialRounds | None = None  # sized at the first round (its number of groups)
        self._pool_sink: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: dict[GroupKey, list[dict]] = {}  # rows of each group in flight
        self._sent: dict[GroupKey, PromptGroup] = {}
        self._key_of: dict[str, GroupKey] = {}  # group id -> key
        self._epoch = -1
        self._cursor: GroupKey | None = None  # the next group of the stream to send
        self._rounds = 0
        self._stash: tuple[list[list[int]], list[list[Any]]] | None = None  # the taken round: prompts, completions

    def start_epoch(self, iterator: Any) -> None:
        super().start_epoch(iterator)
        self._epoch += 1
        self._cursor = (self._epoch, 0, 0)

    def take_round(self, rows: list[dict]) -> list[dict]:
        """The rows this training round trains on, in place of `rows` (the dataloader's for the round): whole
        groups, the oldest complete first. Pushes the weights first when the step changed (as TRL would)."""
        trainer = self.trainer
        started = time.perf_counter()
        if trainer.state.global_step != trainer._last_loaded_step:  # noqa: SLF001 - TRL's rule, applied here
            self.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step  # noqa: SLF001
        n = trainer.num_generations
        if len(rows) % n:
            raise ValueError(f"partial_rollouts needs whole groups of num_generations={n} rows on each rank")
        if self.pool is None:
            self.pool = PartialRounds(len(rows) // n, self.max_partial_rounds, self.partial_overprovision)
        self._top_up(n)
        gate = StalenessGate(self.base_version + trainer.state.global_step - self.max_staleness, self.stale_policy)
        while (taken := self._take(gate)) is None:
            self._collect_one()
        carried = sum(1 for _, _, sent in taken if sent < self._rounds)
        self._rounds += 1
        chosen = [key for key, _, _ in taken]
        new_rows = [row for key in chosen for row in self._rows.pop(key)]
        completions = [c for _, result, _ in taken for c in result.completions]
        prompts = [list(self._sent[key].prompt_ids) for key in chosen for _ in range(n)]
        for key in chosen:
            del self._key_of[self._sent.pop(key).group_id]
        self._stash = (prompts, completions)
        self._log(
            {
                "rollout/partial_carried_over": float(carried),
                "rollout/stale_regenerated": float(len(gate.regenerated)),
                "rollout/wait_s": time.perf_counter() - started,
            }
        )
        self._log_worker_idle()
        return new_rows

    def generate_rows(self, prompt_ids: list[list[int]], **sampling: Any) -> RolloutRows:
        """The completions `take_round` collected for these rows (any other call generates as usual)."""
        if self._stash is None or not self.trainer.model.training:
            return super().generate_rows(prompt_ids, **sampling)
        prompts, completions = self._stash
        self._stash = None
        if [list(p) for p in prompt_ids] != prompts or sampling:
            raise RuntimeError("TRL generated other rows than the partial rollout round handed it")
        lags = [self.token_lags(completion) for completion in completions]
        self._log_lag(lags)
        self.last_routed = completions if self.sampling.get("return_routes") else None
        self.last_round = SampledRound.of(prompts, completions, lags) if self.records_old_logps(self.sampling) else None
        return RolloutRows(
            [c.token_ids for c in completions],
            [c.logprobs for c in completions],
            [c.policy_versions for c in completions],
            [c.finish_reason for c in completions],
        )

    def _send_ahead(self) -> None:
        """Nothing: the pool reads the stream ahead itself (a second generation call in one round, e.g. TRL's tool
        loop, must not send whole rounds that no round would take)."""

    def close(self) -> None:
        """Cancel the groups in flight (and what the parent sent ahead)."""
        for group in self._sent.values():
            self.client.cancel(group.group_id)
        self._sent.clear()
        self._rows.clear()
        self._key_of.clear()
        self.pool = None
        self._stash = None
        while not self._pool_sink.empty():
            self._pool_sink.get_nowait()
        super().close()

    # ---- internals ----------------------------------------------------------------------------------------------
    def _top_up(self, n: int) -> None:
        """Send the stream's next groups until the pool is full (or the epoch's stream ends)."""
        pool, current = self.pool, self.trainer._step - self._epoch_start_step  # noqa: SLF001
        assert pool is not None and self.lookahead is not None and self._cursor is not None
        epoch, index, group = self._cursor
        index = max(index, current)  # never behind the round TRL is on
        while pool.room:
            batch = self.lookahead.at(index)
            if batch is None:
                break
            if group * n >= len(batch):
                index, group = index + self.every, 0
                continue
            rows = list(batch[group * n : (group + 1) * n])
            if len(rows) < n or any(row["prompt"] != rows[0]["prompt"] for row in rows):
                raise ValueError(f"partial_rollouts needs each group's num_generations={n} rows next to each other")
            key = (epoch, index, group)
            group += 1
            if key in pool:
                continue
            prompt_ids, _, _ = self.trainer._tokenize_prompts(copy.deepcopy([rows[0]["prompt"]]))  # noqa: SLF001
            self._rows[key] = rows
            sampling = self.seeded(self.settings_for(list(prompt_ids[0]), self._group_sampling(rows)))
            self._send_group(key, PromptGroup(list(prompt_ids[0]), n, sampling))
            pool.add(key, self._rounds)
        self._cursor = (epoch, index, group)

    def _group_sampling(self, rows: list[dict]) -> dict[str, Any]:
        """The sampling settings of a group (the GRPOConfig's; a benchmark or test may vary them per group)."""
        return dict(self.sampling)

    def _send_group(self, key: GroupKey, group: PromptGroup) -> None:
        call = self.client._submit(group, stream=False, sink=self._pool_sink)  # noqa: SLF001 - same package
        self._sent[key] = call.group
        self._key_of[call.group.group_id] = key

    def _take(self, gate: StalenessGate) -> list | None:
        """The round's groups if they can be taken now; stale complete groups are sent again first."""
        pool = self.pool
        assert pool is not None
        for key, result in pool.completed():
            if gate.must_regenerate(key, result):
                self._resend(key)
        return pool.take(self._rounds)

    def _resend(self, key: GroupKey) -> None:
        old = self._sent.pop(key)
        del self._key_of[old.group_id]
        self._send_group(key, PromptGroup(list(old.prompt_ids), old.n, dict(old.sampling)))
        self.pool.resent(key, self._rounds)

    def _collect_one(self) -> None:
        event = self._next_event(self._pool_sink)  # (pushes the step's weights again to restarted workers)
        if isinstance(event, RolloutError):
            try:
                raise event
            finally:  # the traceback keeps this frame, not the error: no cycle to collect
                event = None
        key = self._key_of.get(event.group_id)
        if key is None:
            return  # a group sent again meanwhile: its first result is nobody's
        if any(c.finish_reason == "error" for c in event.completions):
            error = next(c.error for c in event.completions if c.finish_reason == "error")
            raise RolloutError("error", f"group {event.group_id} failed on its worker: {error}")
        if any(c.finish_reason == "abort" for c in event.completions):
            self._resend(key)
            return
        self.pool.complete(key, event)

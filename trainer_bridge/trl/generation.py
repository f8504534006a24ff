"""TRL's vLLM generation backend, replaced: `RolloutGeneration` has the two methods GRPOTrainer's vLLM path calls,
`sync_weights()` and `generate(...)`, and serves them through rollout workers (see `trainer_bridge.trl`)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from accelerate.utils import broadcast_object_list
from trl import GRPOTrainer

from trainer_bridge.client import GroupResult, PromptGroup, RolloutClient, RolloutError
from trainer_bridge.grpo_sampling import grpo_sampling
from trainer_bridge.trl.old_logps import SampledRound
from trainer_bridge.trl.restarted_workers import generate_groups, learn_pushed_version
from trainer_bridge.weights.lora_push import served_adapter_name
from trainer_bridge.weights.weight_sync import push_weights

__all__ = ["RolloutGeneration", "RolloutRows"]

logger = logging.getLogger("trainer_bridge.trl")


@dataclass
class RolloutRows:
    """Completions of a list of rows, in row order.

    Attributes:
        completion_ids: generated token ids per row (the stop token included when one ended it).
        logprobs: the sampling logprob of every generated token.
        policy_versions: per row, run-length encoded [version, first token index] pairs.
        finish_reasons: "stop" or "length" per row.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    policy_versions: list[list[list[int]]]
    finish_reasons: list[str]


class RolloutGeneration:
    """TRL's vLLM generation backend, replaced: `sync_weights()` and `generate(...)` through rollout workers."""

    def __init__(self, trainer: GRPOTrainer, client: RolloutClient, base_version: int, **push_kwargs: Any):
        """
        Args:
            trainer: the GRPOTrainer (its GRPOConfig gives the sampling settings, its state the step).
            client: this rank's RolloutClient.
            base_version: the workers' policy version for step 0 (their version when training started, plus one).
            **push_kwargs: passed to `push_weights` (mode, transport, bucket_bytes, timeout, ...).
        """
        self.trainer = trainer
        self.client = client
        self.base_version = base_version
        self._last_version: int | None = None  # the version the last sync set
        self.push_kwargs = push_kwargs
        self._group_ids = itertools.count()
        # The groups seeded so far at `_seed_step`, training and evaluation apart (`seeded`).
        self._seeds = {"train": itertools.count(), "eval": itertools.count()}
        self._seed_step: int | None = None
        self.sampling: dict[str, Any] = grpo_sampling(trainer.args, list(trainer.eos_token_ids))
        # The last round's completions in row order when they carry MoE routes (routing replay), else None.
        self.last_routed: list[Any] | None = None
        # The last round's lag-0 rows and their log-probs (batch_invariant skips TRL's old-policy forward with them).
        self.last_round: SampledRound | None = None
        # Device types and dtypes the rollout's log-probs are computed in (server mode: the workers'; colocated: the
        # model's).
        self.devices: set[str] = set()
        self.dtypes: set[str] = set()
        # Prompt + completion tokens at most, and what sets it (server mode: the workers' smallest context; colocated:
        # GRPOConfig.vllm_max_model_length, else the engine's): a completion ends there with finish reason "length",
        # as vLLM's max_model_len ends it on TRL's vLLM path (None: no cap known, the workers refuse what overflows).
        self.context: tuple[int, str] | None = None

    @property
    def last_version(self) -> int | None:
        """The version the last sync pushed (None before the first)."""
        return self._last_version

    def _next_version(self) -> int:
        """The version of the weights a sync makes current: base + global step, and after the first sync always
        above the last one (a new `train()` or a resumed checkpoint starts the step count again; the base moves)."""
        step = self.trainer.state.global_step
        if self._last_version is not None and self.base_version + step <= self._last_version:
            self.base_version = self._last_version + 1 - step
        self._last_version = self.base_version + step
        return self._last_version

    def seeded(self, settings: dict[str, Any]) -> dict[str, Any]:
        """A group's sampling settings with a seed of its own, drawn from `GRPOConfig.seed`, the rank, the optimizer
        step and the groups seeded before it at that step (a `seed` the settings give, from generation_kwargs, is
        kept): two runs with the same seed sample the same completions, as TRL's own generation does, and a run
        resumed from a checkpoint samples its later steps as the uninterrupted run did (rounds generated ahead,
        with max_staleness, are seeded by the step at which they are sent). Evaluation rounds draw their own seeds:
        the Trainer evaluates a step before it saves its checkpoint, and a run resumed there evaluates nothing
        before its first training round."""
        if settings.get("seed") is not None:
            return dict(settings)
        step = self.trainer.state.global_step
        if step != self._seed_step:
            self._seed_step, self._seeds = step, {"train": itertools.count(), "eval": itertools.count()}
        mode = "train" if self.trainer.model.training else "eval"
        place = next(self._seeds[mode])
        tail = str(place) if mode == "train" else f"eval/{place}"  # (training keys as before: the same samples)
        key = f"{self.trainer.args.seed}/{self.trainer.accelerator.process_index}/{step}/{tail}"
        return {**settings, "seed": int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 2}

    def _wait_for_a_worker(self, deadline: float) -> None:
        """Before a push: while no worker is live (one died and is restarting), wait until `deadline` for one to come
        back, as its groups would; then name each worker and how it was lost."""
        client = self.client
        while hasattr(client, "live_workers") and not client.live_workers():
            if time.monotonic() >= deadline or client.closed:
                raise RolloutError(
                    "no_workers",
                    f"no rollout worker to push the weights of step {self.trainer.state.global_step} to came back "
                    f"within the client's timeout ({client.timeout:g} s): {client.outage() or 'none is live'}",
                )
            time.sleep(0.05)

    def sync_weights(self, version: int | None = None) -> None:
        """Push the trainer's weights (every rank calls this; only the main process sends). With no worker live, or
        every one lost during the push, the main process waits for one to come back (a restart) up to the client's
        timeout and every rank pushes again.

        Args:
            version: the policy version to push at (default: the next one, base + global step; a round whose every
                worker restarted after the push pushes the last one again).
        """
        trainer = self.trainer
        main = trainer.accelerator.is_main_process
        version = self._next_version() if version is None else version
        deadline = time.monotonic() + getattr(self.client, "timeout", 0.0)
        while True:
            failure: BaseException | None = None
            pushing = False
            try:
                if main:
                    self._wait_for_a_worker(deadline)
                pushing = True
                push_weights(
                    self.client if main else None,
                    trainer.model_wrapped,
                    version=version,
                    accelerator=trainer.accelerator,
                    **self.push_kwargs,
                )
                # Every rank's rows sample with the adapter a PEFT model's push serves (None: whole weights).
                self.client.adapter = served_adapter_name(
                    trainer.model_wrapped,
                    trainer.accelerator,
                    **{k: v for k, v in self.push_kwargs.items() if k in ("adapters", "adapter_name")},
                )
            except BaseException as error:  # noqa: BLE001 - every rank hears of it below, then raises
                failure = error
            # Every worker lost during the push (no worker holds a part of it): all ranks push again (a collective).
            lost = isinstance(failure, RolloutError) and failure.code == "no_workers"
            again = [main and pushing and lost and time.monotonic() < deadline]
            if trainer.accelerator.num_processes > 1:
                broadcast_object_list(again, from_process=0)
            if not again[0]:
                break
        # Every rank calls this at the same point. The broadcast makes the others wait until the workers serve the
        # new weights (else they would sample their rows with the previous step's), and makes them fail with the
        # main process when its push failed, instead of waiting for it forever.
        try:
            _raise_on_every_rank(trainer.accelerator, failure, "pushing the weights")
        finally:  # the raised failure's traceback holds this frame: not the failure too
            failure = None
        if not main:  # the main process's client raised its floor with the push: this rank's learns it
            learn_pushed_version(self.client, version)

    def generate_rows(self, prompt_ids: list[list[int]], **sampling: Any) -> RolloutRows:
        """Sample one completion per row (consecutive equal prompts form one group) and log the policy lag.

        Args:
            prompt_ids: token ids of each row's prompt.
            **sampling: SamplingParams fields overriding the GRPOConfig-derived ones (e.g. max_new_tokens).
        Raises:
            RolloutError: a worker failed, or a completion ended with an error or was aborted.
        """
        settings = {**self.sampling, **sampling}
        groups: list[PromptGroup] = []
        for row in prompt_ids:
            if groups and groups[-1].prompt_ids == list(row):
                groups[-1].n += 1
            else:
                row_settings = self.seeded(self.settings_for(list(row), settings))
                groups.append(PromptGroup(list(row), 1, row_settings, f"grpo-{next(self._group_ids)}"))
        results = {result.group_id: result for result in self._generate_groups(groups)}
        ordered = [completion for group in groups for completion in results[group.group_id].completions]
        for completion in ordered:
            if completion.finish_reason not in ("stop", "length"):
                raise RolloutError(completion.finish_reason, completion.error or "a completion did not finish")
        lags = [self.token_lags(completion) for completion in ordered]
        self._log_lag(lags)
        self.last_routed = ordered if settings.get("return_routes") else None
        self.last_round = SampledRound.of(prompt_ids, ordered, lags) if self.records_old_logps(settings) else None
        return RolloutRows(
            [c.token_ids for c in ordered],
            [c.logprobs for c in ordered],
            [c.policy_versions for c in ordered],
            [c.finish_reason for c in ordered],
        )

    def settings_for(self, prompt_ids: list[int], settings: dict[str, Any]) -> dict[str, Any]:
        """A group's sampling settings for its prompt: its completion ends where prompt + completion reach the
        `context`, and runs to it when the settings give no length (GRPOConfig.max_completion_length=None), as
        vLLM ends and sizes it on TRL's vLLM path.

        Args:
            prompt_ids: the group's prompt.
            settings: the round's sampling settings (a `SamplingParams` dict).
        Raises:
            ValueError: a prompt that leaves no room for a completion within the context, naming what sets it.
        """
        if self.context is None:
            return settings
        cap, named = self.context
        room = cap - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room for a completion within {named} of {cap} "
                "tokens (prompt + completion)"
            )
        asked = settings.get("max_new_tokens")
        if asked is not None and asked <= room:
            return settings
        # The context ends the completion whatever min_new_tokens asks (vLLM checks max_model_len before min_tokens).
        least = settings.get("min_new_tokens") or 0
        return {**settings, "max_new_tokens": room, **({"min_new_tokens": room} if least > room else {})}

    def _generate_groups(self, groups: list[PromptGroup]) -> Iterable[GroupResult]:
        """The groups' results as they finish, through the workers (`restarted_workers.generate_groups`: the step's
        weights pushed again where every worker restarted since); the colocated and async modes override it."""
        return generate_groups(self, groups)

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        """What TRL's GRPOTrainer calls: (prompt_ids, completion_ids, logprobs, None) for the rows, each token's
        logprob in a list of one."""
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("rollout workers serve text-only models; images are not supported")
        if profiler is None:
            rows = self.generate_rows(prompts)
        else:
            with profiler:
                rows = self.generate_rows(prompts)
        return prompts, rows.completion_ids, [[[lp] for lp in logprobs] for logprobs in rows.logprobs], None

    def records_old_logps(self, settings: dict[str, Any]) -> bool:
        """Whether rows sampled with `settings` have the log-probs TRL's old-policy forward computes: the
        temperature-scaled mode at the trainer's own temperature (generation_kwargs may change either)."""
        mode, temperature = settings.get("logprob_mode"), settings.get("temperature")
        return mode == "temperature_scaled" and temperature == self.trainer.temperature

    def token_lags(self, completion: Any) -> list[int]:
        """Each token's policy lag: the trainer's step now - the step whose weights sampled the token."""
        step = self.trainer.state.global_step
        runs = completion.policy_versions + [[None, len(completion.token_ids)]]
        lags: list[int] = []
        for (version, first), (_, end) in zip(runs, runs[1:]):
            lags += [step - (version - self.base_version)] * (end - first)
        return lags

    def _log_lag(self, row_lags: list[list[int]]) -> None:
        """The rows' policy lag per token, mean and max (this rank's rows)."""
        lags = [lag for row in row_lags for lag in row]
        if lags:
            mode = "train" if self.trainer.model.training else "eval"
            self.trainer._metrics[mode]["rollout/policy_lag_mean"].append(sum(lags) / len(lags))
            self.trainer._metrics[mode]["rollout/policy_lag_max"].append(float(max(lags)))


def _raise_on_every_rank(accelerator: Any, failure: BaseException | None, what: str) -> None:
    """A collective: the main process's outcome goes to every rank; all raise when it failed."""
    outcome: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome, from_process=0)
    if failure is not None:
        try:
            raise failure
        finally:  # the traceback keeps this frame, not the error: no cycle to collect
            failure = None
    if outcome[0] is not None:
        raise RolloutError("main_process_failed", f"the main process failed {what}: {outcome[0]}")

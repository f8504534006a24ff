"""The manager's requests API (`ContinuousBatchingManager` inherits it): requests checked on the caller's thread
(`RequestIntake.prepare` reads no mutable engine state), then handed to the engine thread's mailbox as commands;
cancels likewise. transformers' names (`add_request`, `add_requests`, `cancel_request`) beside the engine's own
(`add_group`, `add_groups`)."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

from rollout.config import FieldError, SamplingParams
from rollout.engine.manager.commands import AddGroup, CancelGroup, Command
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.intake import TRANSFORMERS_FIELD_NAMES

if TYPE_CHECKING:
    from rollout.config import ContinuousBatchingConfig
    from rollout.engine.engine import Engine
    from rollout.engine.manager.results import ResultRouter


class QueueFullError(RuntimeError):
    """Raised by `add_request` when `max_queue_size` requests are already waiting."""


class ManagerRequests:
    """Adding and cancelling requests of a `ContinuousBatchingManager` (its engine, lock, router and mailbox)."""

    engine: Engine
    config: ContinuousBatchingConfig
    _state: threading.Condition
    _router: ResultRouter
    _commands: queue.SimpleQueue[Command]
    _closed: bool
    _num_queued: int
    _next_id: int

    def add_request(
        self,
        input_ids: Any,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        n: int | None = None,
        sampling: SamplingParams | None = None,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        adapter: str | None = None,
        **sampling_fields: Any,
    ) -> str:
        """Queue a prompt for `n` samples; they share the prompt's KV.

        Args:
            input_ids: prompt token ids (a list, or a 1-D / (1, L) tensor).
            request_id: unique id (generated if None). With n > 1, sample i's outputs carry request_id "<id>#<i>".
            max_new_tokens: overrides the sampling / generation config value.
            streaming: deliver a delta (new tokens only) after every token instead of one final output.
            n: number of samples (a GRPO group; None: the GenerationConfig's num_return_sequences, else 1); sample
                i is seeded from (seed, i).
            sampling: per-request SamplingParams (copied at once); None fields come from the generation config.
            record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
            eos_token_id: this request's stop token(s), as in transformers' `add_request`.
            adapter: the LoRA adapter to sample with (`load_adapter`); None: the base model.
            **sampling_fields: SamplingParams fields for this request (`temperature=0.7, top_k=10`, ...), applied
                over `sampling` (or the generation config's defaults), as transformers' per-request processor
                arguments.
        Returns:
            The request (group) id.
        Raises:
            ValueError: bad input, naming the field (also a keyword that is no SamplingParams field).
            QueueFullError: `max_queue_size` requests already wait. RuntimeError: the manager was stopped.
        """
        sampling = self.engine.intake.with_fields(sampling, eos_token_id, sampling_fields)
        with self._state:
            if request_id is None:
                request_id = f"req_{self._next_id}"
                self._next_id += 1
        try:
            return self.add_group(
                request_id,
                input_ids,
                sampling=sampling,
                n=n,
                max_new_tokens=max_new_tokens,
                streaming=streaming,
                record_timestamps=record_timestamps,
                adapter=adapter,
            )
        except FieldError as error:
            raise error.renamed(TRANSFORMERS_FIELD_NAMES) from None

    def add_group(
        self,
        group_id: str,
        prompt_ids: Any,
        *,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        adapter: str | None = None,
    ) -> str:
        """`add_request` in the engine's own terms (the worker's path): the arguments in `Engine.add_request`'s
        order and names, errors naming `group_id` / `prompt_ids`.

        Returns:
            `group_id`.
        Raises:
            FieldError: bad input, naming the field. QueueFullError, RuntimeError: as for `add_request`.
        """
        self.add_groups(
            [group_id],
            [prompt_ids],
            sampling=sampling,
            n=n,
            max_new_tokens=max_new_tokens,
            streaming=streaming,
            record_timestamps=record_timestamps,
            adapter=adapter,
        )
        return group_id

    def add_groups(
        self,
        group_ids: list[str],
        prompts: list[Any],
        *,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        adapter: str | None = None,
    ) -> None:
        """`add_group` for several prompts with the same settings, all or none: every prompt is checked before any
        is queued, so a batch refused at its last prompt gave the engine no work.

        Raises:
            FieldError: bad input, naming the field (`prompt_ids` for any prompt). QueueFullError: the queue cannot
                take them all. RuntimeError: the manager was stopped.
        """
        if len(group_ids) != len(prompts) or len(set(group_ids)) != len(group_ids):
            raise FieldError("group_id", "one distinct group id is needed per prompt")
        requests = []
        for index, (group_id, prompt_ids) in enumerate(zip(group_ids, prompts)):
            try:
                requests.append(
                    self.engine.intake.prepare(
                        GroupSpec(
                            group_id, prompt_ids, sampling, n, max_new_tokens, streaming, record_timestamps, adapter
                        )
                    )
                )
            except FieldError as error:
                if len(prompts) == 1:
                    raise
                raise FieldError(error.field, f"prompt {index} of the batch: {error.reason}") from None
        with self._state:
            if self._closed:
                raise RuntimeError("the manager is stopped; create a new one with init_continuous_batching")
            for group_id in group_ids:
                if self._router.is_open(group_id):
                    raise FieldError("group_id", f"{group_id!r} is already in use by an unfinished request")
            limit = self.config.max_queue_size
            if limit and self._num_queued + self.engine.num_waiting + len(requests) > limit:
                raise QueueFullError(f"queue full: max_queue_size={limit} requests are already waiting")
            for request in requests:
                self._router.open(request.group_id, request.num_forks + 1)
                self._num_queued += 1
                self._commands.put(AddGroup(request))

    def add_requests(
        self,
        inputs: list[Any],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **request_fields: Any,
    ) -> list[str]:
        """`add_request` for each prompt, with generated ids, in order (as transformers' `add_requests`).

        Args: as for `add_request` (`n`, `sampling`, `eos_token_id` and SamplingParams fields as keywords).
        Returns: the request ids. Raises: as `add_request`; requests added before the one that failed stay added.
        """
        if "request_id" in request_fields:
            raise TypeError("add_requests() generates one id per request; use add_request to give your own")
        common = dict(max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=record_timestamps)
        return [self.add_request(prompt, **common, **request_fields) for prompt in inputs]

    @property
    def num_return_sequences(self) -> int:
        """Samples per request when `add_request` is given no `n` (transformers' manager attribute; settable)."""
        return self.engine.intake.default_n

    @num_return_sequences.setter
    def num_return_sequences(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FieldError("num_return_sequences", f"must be an integer >= 1, got {value!r}")
        self.engine.intake.default_n = value

    def cancel_request(self, request_id: str) -> None:
        """Abort a request (every sample of its group); each delivers its partial output with finish_reason "abort".
        Unknown or finished ids are ignored.

        Args:
            request_id: the id returned by `add_request`, or one sample's id ("<id>#<i>").
        """
        group_id = self._router.group_of(request_id)
        if group_id is not None:
            self._commands.put(CancelGroup(group_id))

"""How callers queue requests on a `ContinuousBatchingManager` (its methods, as transformers names them): a prompt
for `n` samples, several prompts, or groups in the engine's own terms (the worker's path), and cancelling them.
Every request is checked on the caller's thread, all or none, and queued through the manager's `RequestDesk`
(request_desk.py); errors name transformers' fields (`input_ids`, `request_id`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.manager.request_desk import RequestDesk
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.intake import TRANSFORMERS_FIELD_NAMES, own_length


class RequestAdding:
    """The manager's request methods; the manager provides `engine` and `_requests`."""

    engine: Engine
    _requests: RequestDesk

    def add_request(
        self,
        input_ids: Any,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        n: int | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = None,
        **sampling_fields: Any,
    ) -> str:
        """Queue a prompt for `n` samples; they share the prompt's KV. The arguments up to `eos_token_id` come in the
        order of transformers' `add_request`, so positional calls carry over.

        Args:
            input_ids: prompt token ids (a list, or a 1-D / (1, L) tensor).
            request_id: unique id (generated if None). With n > 1, sample i's outputs carry request_id `"<id>#<i>"`.
            max_new_tokens: the length, over the generation config's (refused when `sampling` gives another).
            streaming: deliver a delta (new tokens only) after every token instead of one final output.
            record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
            eos_token_id: this request's stop token(s), as in transformers' `add_request` (negative ids: none).
            n: number of samples (a GRPO group; None: the GenerationConfig's num_return_sequences, else 1); sample
                i is seeded from (seed, i).
            sampling: per-request SamplingParams (copied at once); None fields come from the generation config.
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
        self.engine.intake.say_dropped(sampling)
        fields = dict(
            n=n, sampling=sampling, record_timestamps=record_timestamps, eos_token_id=eos_token_id, adapter=adapter
        )
        spec = self._spec(input_ids, request_id, max_new_tokens, streaming, **fields, **sampling_fields)
        self._add([spec])
        return spec.group_id

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
        Returns: the request ids. Raises: as `add_request`, naming the prompt at fault; then none was added.
        """
        if "request_id" in request_fields:
            raise TypeError("add_requests() generates one id per request; use add_request to give your own")
        common = dict(max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=record_timestamps)
        self.engine.intake.say_dropped(request_fields.get("sampling"))
        specs = [self._spec(prompt, **common, **request_fields) for prompt in inputs]
        self._add(specs)  # all or none: the caller gets the ids of every request added, or none was
        return [spec.group_id for spec in specs]

    def _spec(
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
    ) -> GroupSpec:
        """One request as the engine takes it (`add_request`'s arguments)."""
        own = sampling_fields.get("max_new_tokens", own_length(sampling))
        sampling = self.engine.intake.with_fields(sampling, eos_token_id, sampling_fields)
        if max_new_tokens is not None and own is None and sampling is not None:
            # The merged settings carry the generation config's length, a default the call's own overrides (the
            # intake refuses two lengths the request itself gave).
            sampling = dataclasses.replace(sampling, max_new_tokens=None)
        request_id = self._requests.new_id() if request_id is None else request_id
        return GroupSpec(request_id, input_ids, sampling, n, max_new_tokens, streaming, record_timestamps, adapter)

    def _add(self, specs: list[GroupSpec]) -> None:
        """Queue requests, all or none; errors in transformers' names (`input_ids`, `request_id`)."""
        try:
            self._requests.add(specs)
        except FieldError as error:
            raise error.renamed(TRANSFORMERS_FIELD_NAMES) from None

    def add_groups(self, groups: list[GroupSpec]) -> None:
        """Queue groups in the engine's own terms (the worker's path), all or none: every group is checked before any
        is queued, so a batch refused at its last group gave the engine no work.

        Args:
            groups: one `GroupSpec` per group (distinct ids).
        Raises:
            FieldError: bad input, naming the field (`group_id`, `prompt_ids`, ...; with several groups, which one).
            QueueFullError: the queue cannot take them all. RuntimeError: the manager was stopped.
        """
        self._requests.add(groups)

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
            request_id: the id returned by `add_request`, or one sample's id (`"<id>#<i>"`).
        """
        self._requests.cancel(request_id)

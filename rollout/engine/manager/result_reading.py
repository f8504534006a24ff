"""How callers read a `ContinuousBatchingManager`'s outputs (its methods, as transformers names them): a handler per
request, the next output of any request or of one, one request's outputs until it finished, or every output while
the manager runs. All of them read through the manager's `ResultRouter` (results.py) and never block past a timeout
or a stopped manager. None waits on the engine thread (in a result handler): the outputs it would wait for are
the ones that thread produces, so it would wait on itself forever."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from rollout.engine.manager.results import ResultRouter
from rollout.engine.requests.outputs import GenerationOutput
from rollout.validation import check_timeout


class ResultReading:
    """The manager's reading methods; the manager provides `_router`, `is_running` and `_on_engine_thread`."""

    _router: ResultRouter

    def is_running(self) -> bool:
        """True while more outputs may come (the manager's engine thread runs)."""
        raise NotImplementedError  # the manager's own

    def _on_engine_thread(self) -> bool:
        """True when called on the engine thread (from a result handler)."""
        raise NotImplementedError  # the manager's own

    def _refuse_waiting_here(self, what: str) -> None:
        """Raise when the caller is the engine thread: the outputs it would wait for would never come."""
        if self._on_engine_thread():
            raise RuntimeError(
                f"{what} cannot wait for outputs on the engine thread (inside a result handler), which produces "
                "them: it would wait on itself forever; take an output already queued with get_result(timeout=0)"
            )

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call `callback(output)` for every output of a request instead of queueing it: first for outputs already
        waiting, then as they come. Registered from a coroutine, the callback runs on its event loop (through
        `call_soon_threadsafe`, as in transformers); from plain code, on the engine thread. Keep it quick (there,
        calls that wait for the engine, `get_result` with a timeout, `update_weights`, `pause`, raise); exceptions it
        raises are logged. The handler is dropped once the request's last output was delivered.

        Args:
            request_id: a request (group) id or one of its sample ids; an id not added yet is remembered until
                `add_request` uses it (registering first guarantees no output is missed).
            callback: receives each `GenerationOutput`.
        """
        self._router.register_handler(request_id, callback)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """Next output (of `request_id`'s group if given). Returns None on timeout, or at once when the manager is
        not running and nothing matching is waiting, so it never blocks forever.

        Args:
            request_id: a group id or a sample id; None takes any request's output.
            timeout: most seconds to wait (None: until an output arrives or the manager stops).
        Raises:
            RuntimeError: a timeout other than 0 inside a result handler (on the engine thread).
            FieldError: ("timeout") not None or a number of seconds >= 0.
        """
        check_timeout(timeout)
        if timeout != 0:
            self._refuse_waiting_here("get_result")
        return self._router.get(request_id, timeout, self.is_running)

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Yield the outputs of a request (deltas when streaming) until every one of its samples finished.

        Args:
            request_id: the id given to / returned by `add_request` (or one sample's id).
            timeout: most seconds to wait for each output.
        Raises:
            TimeoutError: no output came within `timeout`, or the manager is not running with the request unfinished.
            ValueError: (at the first output asked for) no output of `request_id` is left to read: never added, or
                every one was read.
            RuntimeError: called inside a result handler (on the engine thread).
            FieldError: ("timeout") not None or a number of seconds >= 0.
        """
        check_timeout(timeout)
        self._refuse_waiting_here("request_id_iter")
        return self._router.iter_request(request_id, timeout, self.is_running)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Every output, of any request, as it comes, while the manager runs (as transformers' manager)."""
        self._refuse_waiting_here("iterating the manager")
        while True:
            output = self.get_result(timeout=0.1)
            if output is not None:
                yield output
            elif not self.is_running():
                return

"""How callers read a `ContinuousBatchingManager`'s outputs (its methods, as transformers names them): a handler per
request, the next output of any request or of one, one request's outputs until it finished, or every output while
the manager runs. All of them read through the manager's `ResultRouter` (results.py) and never block past a timeout
or a stopped manager."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from rollout.engine.manager.results import ResultRouter
from rollout.engine.requests.outputs import GenerationOutput


class ResultReading:
    """The manager's reading methods; the manager provides `_router` and `is_running`."""

    _router: ResultRouter

    def is_running(self) -> bool:
        """True while more outputs may come (the manager's engine thread runs)."""
        raise NotImplementedError  # the manager's own

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call `callback(output)` for every output of a request instead of queueing it: first for outputs already
        waiting, then as they come. Registered from a coroutine, the callback runs on its event loop (through
        `call_soon_threadsafe`, as in transformers); from plain code, on the engine thread. Keep it quick;
        exceptions it raises are logged. The handler is dropped once the request's last output was delivered.

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
        """
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
        """
        return self._router.iter_request(request_id, timeout, self.is_running)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Every output, of any request, as it comes, while the manager runs (as transformers' manager)."""
        while True:
            output = self.get_result(timeout=0.1)
            if output is not None:
                yield output
            elif not self.is_running():
                return

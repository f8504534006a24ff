"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: a PEFT adapter directory, named by path
(inside `--control-allowed-dirs`), served under a name as a weight update of its own (a new policy version; the
base weights untouched), or no longer served. Success bodies are vLLM's plain text."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from fastapi.responses import PlainTextResponse

from rollout.config import FieldError
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.engine.requests.adapter_ref import AdapterRef
from rollout.peft_adapters import check_adapter_name
from rollout.service.http.control.allowed_dirs import AllowedDirs
from rollout.service.http.errors import APIError, bad_field

LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace"}
UNLOAD_FIELDS = {"lora_name", "lora_int_id"}
logger = logging.getLogger("rollout.worker")


class UpdateTurns(Protocol):
    """The worker's one weight-update slot, as the HTTP routes take it (`RolloutWorker` is one)."""

    def take_update_turn(self, directory: str) -> str | None:
        """Hold the slot for the update from `directory` until `end_update_turn`: None, or why it cannot."""

    def end_update_turn(self) -> None:
        """Free the slot `take_update_turn` held."""


class AdapterRoutes:
    """Loads and unloads adapters by name for the HTTP control routes; remembers where each came from (the `root`
    /v1/models lists, as vLLM does)."""

    def __init__(self, manager: ContinuousBatchingManager, allowed: AllowedDirs, turns: UpdateTurns | None = None):
        """
        Args:
            manager: the worker's engine manager.
            allowed: the directories adapters may be read from.
            turns: the worker's weight-update slot, which a load takes as `/update_weights` does (a load is a
                weight update of its own: refused while a ZeroMQ push is open); None: none to take.
        """
        self.manager = manager
        self.allowed = allowed
        self.turns = turns
        # Adapter name -> (its served reference, version, the path it was loaded from): a path names only the
        # adapter this route loaded (one pushed or loaded since under the name, or unloaded meanwhile over ZeroMQ,
        # is not from there).
        self._loaded: dict[str, tuple[AdapterRef, int, str]] = {}
        # One load or unload at a time ("already loaded" is decided against the last), and one HTTP weight update: the
        # control routes' /update_weights waits on it too, so an update and a load sent together commit in turn.
        self.lock = asyncio.Lock()

    def roots(self) -> dict[str, str]:
        """Each served adapter this route loaded, and the path it came from (what /v1/models lists as its `root`)."""
        refs = self.manager.engine.runner.adapters.refs
        return {
            name: path
            for name, (ref, version, path) in list(self._loaded.items())
            if refs.get(name) is ref and ref.version == version
        }

    async def load(self, body: Any) -> PlainTextResponse:
        """Serve the adapter at `lora_path` as `lora_name` (`load_inplace`: replace one of that name).

        Raises:
            APIError: 400 a missing or bad field (a name with a control character, the base's `__base__`: named
                `lora_name`), a name served already without load_inplace, an adapter the engine refuses (named);
                403 a path outside the allowed directories; 404 no such directory; 409 (update_in_progress) a
                ZeroMQ weight update is open.
        """
        fields = _fields(body, LOAD_FIELDS)
        name, path = fields.get("lora_name"), fields.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        try:  # named as this route's client sent it (the engine's own checks name the Python API's `name`)
            check_adapter_name(name, "lora_name")
        except FieldError as error:
            raise APIError(400, str(error), "lora_name") from None
        in_place = fields.get("load_inplace", False)
        if not isinstance(in_place, bool):
            raise bad_field("load_inplace", f"must be true or false, got {in_place!r}")
        directory = self.allowed.directory(path, "lora_path")
        async with self.lock:
            # Checked again once the load before this one is done: a link could have replaced it meanwhile.
            directory = self.allowed.directory(path, "lora_path")
            if name in self.manager.engine.runner.adapters.refs and not in_place:
                message = (
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True."
                )
                raise APIError(400, message, "lora_name")
            busy = self.turns.take_update_turn(str(directory)) if self.turns is not None else None
            if busy is not None:
                raise APIError(409, busy, None, "conflict_error", "update_in_progress")
            try:
                await asyncio.to_thread(self.manager.load_adapter, name, str(directory))
            except FieldError as error:
                field = {"lora": "lora_path", "adapter": "lora_name"}.get(error.field, error.field)
                raise APIError(400, f"{field}: {error.reason}", field) from None
            finally:
                if self.turns is not None:
                    self.turns.end_update_turn()
            ref = self.manager.engine.runner.adapters.refs.get(name)
            if ref is not None:
                self._loaded[name] = (ref, ref.version, path)
        logger.info("LoRA adapter %r loaded from %r (POST /v1/load_lora_adapter)", name, str(directory))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: Any) -> PlainTextResponse:
        """Stop serving `lora_name` (its requests in flight end with finish_reason "abort").

        Raises:
            APIError: 400 no name; 404 no adapter of that name is served.
        """
        fields = _fields(body, UNLOAD_FIELDS)
        if fields.get("lora_int_id") is not None:  # vLLM takes it and does nothing with it: refused, not ignored
            raise bad_field("lora_int_id", "adapters are unloaded by name here: send lora_name alone")
        name = fields.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self.lock:
            if name not in self.manager.engine.runner.adapters.refs:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found_error")
            try:
                await asyncio.to_thread(self.manager.control.unload_adapter, name)
            except FieldError as error:  # unloaded meanwhile by another way in
                raise APIError(404, f"lora_name: {error.reason}", "lora_name", "not_found_error") from None
            self._loaded.pop(name, None)
        logger.info("LoRA adapter %r unloaded (POST /v1/unload_lora_adapter)", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _fields(body: Any, known: set[str]) -> dict[str, Any]:
    """The body's fields, every one known (an unknown one is refused by name, never ignored)."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None)
    for field in body:
        if field not in known:
            raise bad_field(field, f"unknown field (this route takes {sorted(known)})")
    return body

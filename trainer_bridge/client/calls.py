"""What a RolloutClient call is made of: the caller's `PromptGroup`, the `GroupResult` (or, for a weight push, the
`PushResult`) it gets back, the errors it may raise, and the state the I/O thread keeps for it (`Call`, and
`AsyncSink` for coroutines)."""

from __future__ import annotations

import asyncio
import hashlib
import operator
import queue
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from rollout.config import FieldError, SamplingParams
from rollout.peft_adapters import BASE_NAME
from rollout.protocol import Completion, Delta, GroupResult  # (GroupResult: re-exported, one class for both sides)
from rollout.protocol.message_base import MAX_HEADER_STR, MAX_ID_LENGTH


@dataclass
class PromptGroup:
    """A prompt to sample `n` completions of (a GRPO group).

    Args:
        prompt_ids: the prompt's token ids.
        n: how many completions to sample (the prompt is prefilled once).
        sampling: a `rollout.SamplingParams`, or a dict of its field names (temperature, top_p, max_new_tokens,
            seed, ...). A group without a seed gets one, so a group resubmitted after a failover reproduces its
            tokens.
        group_id: the group's id in results and `cancel` (non-empty, without '#', not ending with '~retry' and a
            number: a resubmitted group's id); None: the client makes one.
        adapter: the served LoRA adapter to sample with. None: the adapter this client last pushed (`push_weights`
            of a PEFT model), else the base model; `"__base__"`: the base model in any case.
        session_id: groups of one session (an agent's conversation) go to the worker that served the session's
            last group, when it is not much busier than the others; None: the prompt's own prefix decides
            (`trainer_bridge.client.affinity`).
    """

    prompt_ids: list[int]
    n: int = 1
    sampling: SamplingParams | dict[str, Any] = field(default_factory=dict)
    group_id: str | None = None
    adapter: str | None = None
    session_id: str | None = None


def aborted_result(group: PromptGroup) -> GroupResult:
    """What the waiter of a group cancelled with `RolloutClient.cancel` gets when no worker can answer the cancel (the
    group's worker was lost, or it was waiting for one): every sample aborted, without tokens.

    Args:
        group: the checked group (its id, prompt and n).
    """
    completions = [Completion(index, [], [], "abort") for index in range(group.n)]
    return GroupResult(group.group_id, list(group.prompt_ids), completions)


def sample_oldest_version(completion: Completion) -> int:
    """The oldest weights behind a sample: its first token's version, or its KV's if older (a prompt computed under
    earlier weights)."""
    first = completion.policy_versions[0][0] if completion.policy_versions else completion.kv_version_min
    return min(first, completion.kv_version_min)


def oldest_version(result: GroupResult) -> int:
    """The oldest weights behind any sample of a group (`sample_oldest_version`)."""
    return min(sample_oldest_version(completion) for completion in result.completions)


class RolloutError(RuntimeError):
    """A worker refused or failed a request, or no answer came in time. `code` and `field` are kept as attributes."""

    def __init__(self, code: str, message: str, field: str | None = None):
        """
        Args:
            code: the worker's error code ("bad_request", "busy", "timeout", "no_workers", ...).
            message: what went wrong, in words (the exception's text, after the code).
            field: the offending field, when one was named.
        """
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.field = field


def timed_out(message: str, outage: str | None) -> RolloutError:
    """A "timeout" error whose message says, where no worker serves, which ones are lost and since when.

    Args:
        message: what did not come in time.
        outage: `RolloutClient.outage()`.
    """
    return RolloutError("timeout", message if outage is None else f"{message}: {outage}")


class WorkerBusy(RolloutError):
    """The worker's queue is full (code "busy"); retry later or add workers.

    Args:
        code: "busy".
        message: the worker's words for it.
        field: None (no field is at fault).
    """


@dataclass
class WorkerLost:
    """Put in every open weight update's replies when the client declares a worker dead (the push goes on without
    it)."""

    address: str


@dataclass
class PushResult:
    """What a push did.

    Attributes:
        version: the policy version every worker now serves.
        num_bytes: bytes of the update (per worker).
        transfer_s: seconds from the first begin to the last bucket acknowledged by every worker.
        total_s: seconds of the whole push, commits included.
        workers: per worker: address, transport, version, pause_ms, copy_ms, drain_ms, aborted, recomputed.
        base_included: an adapter-only push that also carried the frozen base (a worker did not hold it yet);
            `num_bytes` then counts the base too.
    """

    version: int
    num_bytes: int
    transfer_s: float
    total_s: float
    workers: list[dict[str, Any]] = field(default_factory=list)
    base_included: bool = False

    @property
    def gb_per_s(self) -> float:
        """Update bytes per second of transfer, per worker (1 GB = 1e9 bytes)."""
        return self.num_bytes / max(self.transfer_s, 1e-9) / 1e9


@dataclass
class Call:
    group: PromptGroup
    cost: int
    # Where Delta, GroupResult or RolloutError events go: a queue.SimpleQueue, or an AsyncSink for coroutines.
    events: Any = field(default_factory=queue.SimpleQueue)
    worker: int | None = None
    stream: bool = False
    # Per sample index: tokens handed to the caller, and tokens received from the current worker. After a failover
    # the new worker resends from token 0 (same seed, same tokens); only positions >= delivered are passed on.
    delivered: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    # The id the current worker knows the group by: the group id at first, `retry_wire_id` after a failover, so a
    # resubmission never collides with the first run (still running on a worker that was only slow).
    wire_id: str = ""
    attempts: int = 0
    cancelled: bool = False  # the caller gave up on it (a failover finishes it instead of resubmitting)
    abandoned: bool = False  # its own caller stopped waiting (nobody reads its events): a new call may take its id


RETRY_MARK = "~retry"
_RETRY_ENDING = re.compile(re.escape(RETRY_MARK) + r"[0-9]+\Z")


def retry_wire_id(group_id: str, attempt: int) -> str:
    """The id a group's `attempt`-th resubmission travels under: "<group id>~retry<attempt>", or a digest of the group
    id in its place where that would pass the worker's id limit (`MAX_ID_LENGTH`). No group id a caller may give ends
    like it (`checked_group`), so it is never the id of another group of the client.

    Args:
        group_id: the group's id.
        attempt: 1 for its first resubmission, and so on.
    """
    suffix = f"{RETRY_MARK}{attempt}"
    if len(group_id) + len(suffix) > MAX_ID_LENGTH:
        group_id = hashlib.sha256(group_id.encode("utf-8")).hexdigest()
    return group_id + suffix


class AsyncSink:
    """Where the I/O thread puts a call's events when the caller is a coroutine: straight into an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(
        self, timeout: float, group_id: str, outage: Callable[[], str | None] | None = None
    ) -> Delta | GroupResult:
        """The call's next event, waited for at most `timeout` seconds.

        Args:
            timeout: seconds to wait.
            group_id: the group waited for (what a timeout names).
            outage: `RolloutClient.outage`, for a timeout to say why no worker serves (None: it says nothing).
        Raises:
            RolloutError: the event was an error, or none came in time.
        """
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise timed_out(f"group {group_id!r}: no answer in time", outage and outage()) from None
        if isinstance(event, RolloutError):
            try:
                raise event
            finally:  # the traceback keeps this frame: not the error too (a cycle only a collection frees,
                event = None  # holding the closed client with its callers' frames)
        return event


_INT64 = 1 << 63  # ids and counts travel as msgpack integers


def as_integer(value: Any) -> int | None:
    """`value` as a Python int when it is an integer: an int, or a numpy / torch integer scalar (converted with
    `operator.index`); None for anything else, bools included (True is no count or version).

    Args:
        value: what the caller gave.
    """
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None  # (numpy bools refuse operator.index; a torch bool tensor would give 0 or 1)
    try:
        return operator.index(value)
    except TypeError:
        return None


def _plain(value: Any) -> Any:
    """A sampling value as plain Python: numpy / torch scalars and arrays become numbers and lists, recursively."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):  # logit_bias: {token id: bias}
        return {_plain(key): _plain(item) for key, item in value.items()}
    return value


_UNPACKABLE = (TypeError, ValueError, OverflowError, RuntimeError)


def _packable(fields: dict[Any, Any]) -> dict[Any, Any]:
    """`fields` as plain Python values that msgpack writes; a value it cannot write is refused naming its key
    (`sampling.<key>`, as the worker names sampling fields), an integer too large for the wire with the range.

    Args:
        fields: a PromptGroup's sampling dict.
    Raises:
        RolloutError: code "bad_request", naming the field.
    """
    sampling = {}
    for key, value in fields.items():
        field = f"sampling.{key}"
        try:
            sampling[key] = _plain(value)
            msgpack.packb(sampling[key])
        except OverflowError:
            try:  # the worker's own words for the field, where it has them (seed)
                SamplingParams.from_fields({key: sampling[key]})
            except FieldError as error:
                raise RolloutError("bad_request", str(error), error.field) from None
            except Exception:  # noqa: BLE001 - the worker's check fails otherwise on it: the general reason below
                pass
            plain = sampling[key]
            what = f"{plain} is" if isinstance(plain, int) else "holds an integer"
            reason = f"{field}: {what} outside [-2**63, 2**64), the integers the wire carries"
            raise RolloutError("bad_request", reason, field) from None
        except _UNPACKABLE as error:
            reason = f"{field}: sampling values must be plain numbers/strings/lists: {error}"
            raise RolloutError("bad_request", reason, field) from None
    try:  # (a key msgpack cannot write)
        msgpack.packb(sampling)
    except _UNPACKABLE as error:
        raise RolloutError(
            "bad_request", f"sampling values must be plain numbers/strings/lists: {error}", "sampling"
        ) from None
    return sampling


def checked_group(
    group: PromptGroup, new_seed: Callable[[], int], new_group_id: Callable[[], str], adapter: str | None = None
) -> PromptGroup:
    """A copy of `group` with plain Python values (numpy/torch scalars unwrapped), a seed and a group id; bad values
    raise here, in the caller's thread, naming the field.

    Args:
        group: the caller's group.
        new_seed: draws the seed of a group that has none (a resubmitted group then reproduces its tokens).
        new_group_id: makes the id of a group that has none.
        adapter: the adapter of a group that names none (the client's last pushed one).
    Raises:
        RolloutError: code "bad_request", naming the field.
    """
    try:
        prompt_ids = [operator.index(token) for token in group.prompt_ids]
    except TypeError:
        raise RolloutError("bad_request", "token ids must be integers", "prompt_ids") from None
    if not all(0 <= token < _INT64 for token in prompt_ids):
        raise RolloutError("bad_request", "token ids must be in [0, 2**63)", "prompt_ids")
    n = as_integer(group.n)  # numpy / torch integers too, as for prompt_ids
    if n is None or not 0 < n < _INT64:
        raise RolloutError("bad_request", f"n must be a positive integer, got {group.n!r}", "n")
    if group.group_id is not None and not isinstance(group.group_id, str):
        raise RolloutError("bad_request", f"group_id must be a string, got {group.group_id!r}", "group_id")
    if group.group_id == "":  # only None means "make one": an empty id is a mistake, not a request for a new one
        raise RolloutError("bad_request", "group_id must be a non-empty string, or None for one made here", "group_id")
    try:
        encoded = (group.group_id or "").encode("utf-8")
    except UnicodeEncodeError:
        raise RolloutError("bad_request", "group_id must be valid Unicode text", "group_id") from None
    if len(encoded) > MAX_HEADER_STR:  # the worker could not read it back to answer: refused here, by name
        reason = f"group_id is {len(encoded):,} bytes; a worker reads strings of at most {MAX_HEADER_STR:,}"
        raise RolloutError("bad_request", reason, "group_id")
    if len(group.group_id or "") > MAX_ID_LENGTH:  # a worker refuses it: a cancel naming it must stay small
        reason = f"group_id is {len(group.group_id):,} characters; a worker takes ids of at most {MAX_ID_LENGTH:,}"
        raise RolloutError("bad_request", reason, "group_id")
    if "#" in (group.group_id or ""):  # the worker's sample ids are group_id#index
        raise RolloutError("bad_request", "group_id must not contain '#' (sample ids use it)", "group_id")
    if _RETRY_ENDING.search(group.group_id or ""):  # a resubmitted group's wire id would be this group's id
        reason = f"group_id must not end with {RETRY_MARK!r} and a number (resubmitted groups' ids end so)"
        raise RolloutError("bad_request", reason, "group_id")
    if isinstance(group.sampling, SamplingParams):  # (its values may be past what the wire carries: 2**70)
        sampling = _packable(group.sampling.changed_fields())
    elif isinstance(group.sampling, dict):
        sampling = _packable(group.sampling)
    else:
        raise RolloutError("bad_request", "sampling must be a SamplingParams or a dict of its fields", "sampling")
    try:  # the worker's own check, here in the caller's thread
        checked = SamplingParams.from_fields(sampling)
    except FieldError as error:
        raise RolloutError("bad_request", str(error), error.field) from None
    if "logit_bias" in sampling:  # as (token id, bias) pairs: the worker takes maps with string keys only
        sampling["logit_bias"] = checked.changed_fields().get("logit_bias", [])
    sampling.setdefault("seed", new_seed())  # a resubmitted group reproduces its tokens
    group_id = group.group_id or new_group_id()
    chosen = group.adapter if group.adapter is not None else adapter
    if chosen is not None and (not isinstance(chosen, str) or not chosen):
        raise RolloutError("bad_request", f"adapter must be a non-empty string, got {chosen!r}", "adapter")
    if group.session_id is not None and not isinstance(group.session_id, str):
        raise RolloutError("bad_request", f"session_id must be a string, got {group.session_id!r}", "session_id")
    adapter = None if chosen == BASE_NAME else chosen
    return PromptGroup(prompt_ids, n, sampling, group_id, adapter, session_id=group.session_id)

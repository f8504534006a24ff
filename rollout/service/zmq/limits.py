"""Limits an operator sets on a worker (`rollout-worker --max-...`), so that no client can make the serving loop
stall or the worker's memory grow without bound. Each is enforced with an error reply naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rollout.config import FieldError
from rollout.protocol import messages as p
from rollout.sampling_params import served_logprobs_refusal
from rollout.service.compile.jobs import CompileBudget

MAX_SESSION_CHARS = 64  # `Generate.session`: a client's secret, 32 hex characters from RolloutClient
# The largest byte and seconds limits: past them a limit no longer fits where it is used (ZeroMQ's MAXMSGSIZE and
# setrlimit take a C long; a thread's wait, a time_t), and the worker failed at its socket's bind with a traceback,
# or on every structured output or compile wait, instead of refusing the flag.
MAX_LIMIT_BYTES = 1 << 62  # 4 EiB
MAX_LIMIT_SECONDS = 10**7  # about 116 days
_BYTE_LIMITS = ("max_message_bytes", "max_pending_bytes", "max_compile_bytes")
_SECONDS_LIMITS = ("max_update_phase_s", "client_timeout_s", "max_compile_s")


@dataclass
class WorkerLimits:
    """What one client may ask of a worker.

    Attributes:
        max_message_bytes: largest frame accepted (a larger one drops the connection: ZeroMQ's MAXMSGSIZE), and
            the most data frames one message may carry together (a larger message is refused). Keep it at least
            the trainers' `bucket_bytes`.
        max_prompt_len: longest prompt, in tokens (None: the model's context length). Checked from the list's
            length before any element is looked at.
        max_n: most samples per group.
        max_groups_per_client: most groups one client (with keys: one key, over all its connections) may have in
            flight (0: no limit); past it, "busy".
        max_pending_bytes: most bytes of memory the replies queued for a client that does not read them may hold
            (their Python objects counted); past it the client is dropped and its groups cancelled.
        max_update_phase_s: longest `timeout_s` a weight update may ask for (the most one update can hold the update
            slot without a message).
        client_timeout_s: a client with groups in flight that sends nothing (not even ping) for this long is
            considered gone and its groups are cancelled (RolloutClient pings every second).
        max_compile_s: a structured-output constraint still compiling after this long is killed and refused by
            name (over ZeroMQ and HTTP alike).
        max_compile_bytes: memory one constraint's compile may allocate; past it, refused by name.
        max_compiles_per_client: constraints one client may have compiling or waiting to compile; more, "busy".
    """

    max_message_bytes: int = 256 << 20
    max_prompt_len: int | None = None
    max_n: int = 1024
    max_groups_per_client: int = 0
    max_pending_bytes: int = 256 << 20
    max_update_phase_s: float = 600.0
    client_timeout_s: float = 30.0
    max_compile_s: float = 10.0
    max_compile_bytes: int = 1 << 30
    max_compiles_per_client: int = 32

    def __post_init__(self):
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is None and item.name == "max_prompt_len":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FieldError(item.name, f"must be a number, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison, inf never ends
                raise FieldError(item.name, f"must be a finite number, got {value!r}")
            if item.name == "max_groups_per_client" and value < 0:
                raise FieldError(item.name, f"must be 0 (no limit) or more, got {value!r}")
            if value <= 0 and item.name != "max_groups_per_client":
                raise FieldError(item.name, f"must be positive, got {value!r}")
            if item.name in _BYTE_LIMITS and value > MAX_LIMIT_BYTES:
                raise FieldError(item.name, f"must be at most {MAX_LIMIT_BYTES} (2**62 bytes), got {value!r}")
            if item.name in _SECONDS_LIMITS and value > MAX_LIMIT_SECONDS:
                raise FieldError(item.name, f"must be at most {MAX_LIMIT_SECONDS} seconds, got {value!r}")
        if self.max_message_bytes < 1 << 10:
            raise FieldError("max_message_bytes", f"must be at least 1024, got {self.max_message_bytes}")

    def compile_budget(self) -> CompileBudget:
        """What one structured-output compile may take, by these limits."""
        return CompileBudget(self.max_compile_s, self.max_compile_bytes, self.max_compiles_per_client)


def generate_refusal(limits: WorkerLimits, message: p.Generate, running: bool, client_groups: int) -> p.Error | None:
    """Why a worker refuses a generate message before the engine sees it (None: it does not).

    Args:
        limits: the worker's limits.
        message: the request.
        running: a group of this client with the same id is still running.
        client_groups: groups this client has in flight.
    """
    if "#" in message.group_id:  # (the engine refuses it too, but naming the id it made of the client's)
        reason = "group_id: must not hold '#' (the ids of a group's samples use it)"
        return p.Error("bad_request", reason, "group_id", message.group_id)
    if running:
        reason = "a group of this client with this id is still in flight (running, or cancelled and not ended yet)"
        return p.Error("duplicate_group", reason, "group_id", message.group_id)
    if not 1 <= message.n <= limits.max_n:
        reason = f"must be in [1, {limits.max_n}] (the worker's --max-n), got {message.n}"
        return p.Error("bad_request", f"n: {reason}", "n", message.group_id)
    most = limits.max_groups_per_client
    if most and client_groups >= most:
        reason = f"this client already has {most} groups in flight (the worker's --max-groups-per-client)"
        return p.Error("busy", reason, None, message.group_id)
    if not isinstance(message.session, str) or len(message.session) > MAX_SESSION_CHARS:
        reason = f"must be a string of at most {MAX_SESSION_CHARS} characters"
        return p.Error("bad_request", f"session: {reason}", "session", message.group_id)
    reason = served_logprobs_refusal(message.sampling.get("top_logprobs") if isinstance(message.sampling, dict) else 0)
    if reason is not None:
        return p.Error("bad_request", f"sampling.top_logprobs: {reason}", "sampling.top_logprobs", message.group_id)
    return None

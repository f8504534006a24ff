"""`unload_adapter`: a LoRA adapter that `push_weights(..., adapter_name=...)` added stops serving on every worker of
a client, freeing its slot (`--max-loras`) for another. No tensor travels and no torch is needed: one
`adapter_unload` message per worker, over the client's update channel."""

from __future__ import annotations

import time
import uuid

from rollout import protocol as p
from trainer_bridge.client.calls import RolloutError, WorkerLost
from trainer_bridge.client.rollout_client import RolloutClient

POLL_S = 0.5  # how long one wait for a reply lasts before the deadline is looked at again


def unload_adapter(client: RolloutClient, adapter_name: str, timeout: float = 60.0) -> int:
    """Stop serving LoRA adapter `adapter_name` on every live worker of `client`. Its groups, queued or running, end
    with finish_reason "abort" (a call waiting on one gets that result), then its slot is freed. The policy version
    does not change. When it was the adapter `client` samples with by default (its last push's), the client's groups
    that name none sample with the base model again.

    A worker that was down meanwhile still serves it when it comes back: unload again then. An unload that timed out
    may still be carried out by a worker that answers late (one stopped meanwhile, say): `client.stats()` says which
    adapters each worker serves.

    Args:
        client: the `RolloutClient` whose workers serve the adapter (with keys on, its key must be a trainer's).
        adapter_name: the served adapter's name, as pushed (`push_weights(..., adapter_name=...)`) or given to
            `rollout-worker --lora NAME=PATH`.
        timeout: most seconds to wait for every worker's answer.
    Returns:
        How many samples the unload ended, over all workers.
    Raises:
        RolloutError: "bad_request" (field "adapter_name") a name that is not a non-empty string, or one that no
            worker serves; "no_workers" no live worker; "unauthorized" the client's key is not a trainer's;
            "timeout" a worker did not answer in time (named); "closed" the client is closed, or was closed meanwhile.
    """
    if not isinstance(adapter_name, str) or not adapter_name:
        raise RolloutError(
            "bad_request", f"the adapter's name, a non-empty string, got {adapter_name!r}", "adapter_name"
        )
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise RolloutError("bad_request", f"seconds to wait, a number above 0, got {timeout!r}", "timeout")
    deadline = time.monotonic() + timeout
    update_id = f"unload-{uuid.uuid4().hex}"
    channel = client.open_update_channel(update_id)  # "closed" on a closed client
    try:
        waiting = {index: client.worker_address(index) for index in client.wait_connected()}
        if not waiting:
            raise RolloutError("no_workers", "no live rollout worker to unload the adapter from")
        for index in waiting:
            channel.send(index, p.AdapterUnload(update_id, adapter_name))
        aborted, served, unknown = 0, 0, []
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = ", ".join(sorted(waiting.values()))
                raise RolloutError(
                    "timeout", f"no answer to the unload of {adapter_name!r} within {timeout:g} s from {late}"
                )
            try:
                index, message = channel.receive(min(remaining, POLL_S))
            except RolloutError:  # nothing within the poll: look at the deadline, and the client, again
                if client.closed:
                    raise RolloutError(
                        "closed", f"the client was closed during the unload of {adapter_name!r}"
                    ) from None
                continue
            address = waiting.pop(index, None)
            if address is None or isinstance(message, WorkerLost):
                continue  # a worker that answered already, or one declared dead meanwhile (it serves nothing now)
            if isinstance(message, p.AdapterUnloaded):
                aborted, served = aborted + message.aborted, served + 1
            elif isinstance(message, p.Error) and message.code == "bad_request" and message.field == "adapter":
                unknown.append(f"{address}: {message.message}")  # not served there: nothing to unload
            else:  # an error of another kind (unauthorized, internal)
                field = "adapter_name" if message.field == "adapter" else message.field
                raise RolloutError(message.code, f"worker {address} refused the unload: {message.message}", field)
        if not served and unknown:
            reason = f"no worker serves an adapter named {adapter_name!r} ({'; '.join(unknown)})"
            raise RolloutError("bad_request", reason, "adapter_name")
        if not served:
            raise RolloutError("no_workers", "every worker was lost before it answered the unload")
        if client.adapter == adapter_name:  # its groups that name no adapter sample with the base again
            client.adapter = None
        return aborted
    finally:
        channel.close()

"""Weight transports: how a weight update's bucket bytes travel from the trainer into a worker's staging area.

A transport is one module here holding both halves of one interface (`base.py`): its `Sender`, which the trainer's
push uses (`trainer_bridge.weights.push`), and its `Receiver`, which the worker's update slot uses
(`rollout.service.weights`). `TRANSPORTS` below is the one registry: adding a transport is one new module, one line
here, and its tests.

- `frames.py`: each bucket's bytes as raw ZeroMQ frames after its header (any host);
- `shm.py`: the trainer writes into the worker's staging area, a shared-memory segment (same host: one copy);
- `torch_distributed.py`: each bucket broadcast over a process group (gloo, or NCCL from GPU memory).

The registry names modules rather than importing them: the wire messages read the names without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.protocol.transports.base import WeightTransport

# Transport name (the `transport` field of weights_begin) -> the module defining its `TRANSPORT`.
TRANSPORTS: dict[str, str] = {
    "frames": "rollout.protocol.transports.frames",
    "shm": "rollout.protocol.transports.shm",
    "torch.distributed": "rollout.protocol.transports.torch_distributed",
}
WEIGHT_TRANSPORTS = tuple(TRANSPORTS)


def transport_named(name: str) -> WeightTransport:
    """The transport of this name.

    Args:
        name: one of `WEIGHT_TRANSPORTS`.

    Raises:
        KeyError: an unknown name (callers check the field first and refuse it by name).
    """
    return importlib.import_module(TRANSPORTS[name]).TRANSPORT

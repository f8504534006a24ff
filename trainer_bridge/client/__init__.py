"""`RolloutClient` and its machinery, in the order a call passes through them: `rollout_client.py` (the public
`RolloutClient`, sync and asyncio) with `membership.py` (which workers it uses, which answer), `caller.py` (a generation call in the caller's thread: the group checked, seeded,
submitted, waited for, cancelled when the caller stops waiting), `calls.py` (a call's `PromptGroup`, its
`GroupResult` or `PushResult`, the errors, the state kept per call), `commands.py` (what caller threads put in the
I/O thread's mailbox), `dispatcher.py` (the I/O thread, the one owner of the sockets) with `stream_splice.py` (a
stream resent after a failover passes on only what its caller lacks), `routing.py` (which worker a group goes to)
with `affinity.py` (a prompt that extends a recent one goes to that one's worker), `links.py` (the socket to one
worker), `liveness.py` (pings, a dead worker's groups failed over, a returning one used again); and
`update_channel.py` (a weight update's own link to the workers, which `trainer_bridge.weights` drives)."""

from trainer_bridge.client.rollout_client import (
    Completion,
    Delta,
    GroupResult,
    PromptGroup,
    RolloutClient,
    RolloutError,
    WorkerBusy,
)

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]

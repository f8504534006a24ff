"""The express lane: a small share of the KV cache where a short request is admitted past the growth reserve and
past a queue head that does not fit. Never imports torch.

The admission gate (`admission.py`) keeps free blocks for the running requests' expected growth, and the waiting
queue is served in turn order. Both are right for long rollouts, and both make a short request wait: an eval or an
agent call of a few dozen tokens, sent while a trainer's long groups fill the cache, waits until enough of them end
(a thousand steps, measured with 512 samples of lognormal lengths in a cache holding a third of them), though it
would hold a few blocks for a few steps.

So a request whose whole life fits in the lane (its prompt and max_new_tokens, every sample of its group counted:
`life_blocks`) is admitted when its life's blocks are free now and the lane has room for them, whatever the
reserve and whatever waits ahead of it; it still needs a free sequence slot. The lane's room is
`EXPRESS_FRACTION` of the cache (at least one block), minus the lives of the lane's groups still running: however
many short requests arrive, they take that share at most, and the running requests may have to give back at most
that share (preemption, as when their growth outruns the reserve). Admitted through the lane or not, a request is
the same request: its tokens do not depend on how it was admitted. Its length does not teach the growth reserve
(`AdmissionGate.finished`): the reserve's estimate is of the requests it admits.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import cdiv

EXPRESS_FRACTION = 0.02  # the share of the cache's blocks the lane's running groups may hold at once


def life_blocks(request: Request, block_size: int) -> int:
    """The most blocks a group holds over its life: its prompt and max_new_tokens - 1 tokens (the last token is
    never fed back), and for each sample it will fork, the blocks past the prompt's full blocks they share.

    Args:
        request: a waiting request (a group leader counts its unforked samples through `num_forks`).
        block_size: tokens per block.
    """
    own = request.num_prompt_tokens + request.max_new_tokens - 1
    per_fork = cdiv(request.max_new_tokens - 1, block_size) + 1  # its copy of the shared partial block, then its own
    return cdiv(own, block_size) + request.num_forks * per_fork


class ExpressLane:
    """The lane's room, and which running groups hold it (the admission gate's; torch-free)."""

    def __init__(self, num_blocks: int, block_size: int, fraction: float = EXPRESS_FRACTION):
        """
        Args:
            num_blocks: the cache's blocks.
            block_size: tokens per block.
            fraction: the share of the blocks the lane may hold at once.
        """
        self.capacity = max(1, int(num_blocks * fraction))
        self.block_size = block_size
        self._groups: dict[str, int] = {}  # group id -> its life's blocks, while a sample of it runs

    def used(self, running: Iterable[Request]) -> int:
        """The blocks the lane's running groups may hold (their lives'); forgets the groups no sample of runs.

        Args:
            running: the running requests.
        """
        if not self._groups:
            return 0
        live = {request.group_id for request in running} & self._groups.keys()
        self._groups = {group: blocks for group, blocks in self._groups.items() if group in live}
        return sum(self._groups.values())

    def holds(self, group_id: str) -> bool:
        """Whether the lane admitted this group (and it has not left the running requests since).

        Args:
            group_id: the group's id.
        """
        return group_id in self._groups

    def took(self, request: Request) -> None:
        """`request` was admitted through the lane: its group holds its life's blocks of the lane while it runs.

        Args:
            request: the admitted request.
        """
        self._groups[request.group_id] = life_blocks(request, self.block_size)

"""The express lane: a small share of the KV cache where a short request is admitted past the growth reserve and
past a queue head that does not fit. Never imports torch.

The admission gate (`admission.py`) keeps free blocks for the running requests' expected growth, and the waiting
queue is served in turn order. Both are right for long rollouts, and both make a short request wait: an eval or an
agent call of a few dozen tokens, sent while a trainer's long groups fill the cache, waits until enough of them end
(a thousand steps, measured with 512 samples of lognormal lengths in a cache holding a third of them), though it
would hold a few blocks for a few steps.

So a request whose whole life fits in the lane (its prompt and max_new_tokens, every sample of its group counted:
`life_blocks`) is admitted when its life's blocks are free now and the lane has room for them, whatever the
reserve and whatever waits ahead of it. The lane's room is `EXPRESS_FRACTION` of the cache (at least one block),
minus the shares of the lane's samples still running: however many short requests arrive, they take that share at
most, and the running requests may have to give back at most that share (preemption, as when their growth outruns
the reserve). The lane has sequence slots of its own too, `EXPRESS_SEQ_FRACTION` of `max_num_seqs` (at least one),
used when the running set has none left (a group of more samples than `max_num_seqs` fills it for its whole life):
a step computes the lane's samples first (a lane prompt's chunk leaving the decodes behind it a token each), and the
others in the slots left, so the running set may exceed `max_num_seqs` by the lane's slots while a step never does.
Admitted through the lane or not, a request is the same request: its tokens do not depend on how it was admitted.
Its length does not teach the growth reserve (`AdmissionGate.finished`): the reserve's estimate is of the requests
it admits. A preempted sample does not come back through the lane (it would be preempted again at once; a swapped
one comes back through the gate, with no share), so the lane's samples are the last a preemption takes
(`admission.cheapest_victim`), and the lane looks past the preempted samples at the queue's head (a big group's,
by the hundred) for a short request behind them. The lane closes behind a request that may only be admitted once
nothing runs (short requests passing it would keep something running for ever).
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import cdiv

EXPRESS_FRACTION = 0.02  # the share of the cache's blocks the lane's running samples may hold at once
EXPRESS_SEQ_FRACTION = 1 / 16  # the share of max_num_seqs the lane's samples may take past a full running set


def life_blocks(request: Request, block_size: int) -> int:
    """The most blocks a group holds over its life: its prompt and max_new_tokens - 1 tokens (the last token is
    never fed back), and for each sample it will fork, the blocks past the prompt's full blocks they share.

    Args:
        request: a waiting request (a group leader counts its unforked samples through `num_forks`).
        block_size: tokens per block.
    """
    own = request.num_prompt_tokens + request.max_new_tokens - 1
    return cdiv(own, block_size) + request.num_forks * fork_share(request, block_size)


def fork_share(request: Request, block_size: int) -> int:
    """The most blocks one forked sample of `request`'s group holds alone: its copy of the prompt's shared partial
    block, then its own tokens.

    Args:
        request: the group's leader.
        block_size: tokens per block.
    """
    return cdiv(request.max_new_tokens - 1, block_size) + 1


class ExpressLane:
    """The lane's room: its capacity less the shares of its running samples (the admission gate's; torch-free).

    Each sample admitted through the lane carries its share (`Request.express_blocks`: the leader its life but for
    its forks', each fork `fork_share`), so the lane's use is a sum over the running samples: a preempted sample
    leaves it by leaving the running ones, and one readmitted otherwise carries none. The prompt's full blocks are in
    the leader's share, but every fork holds them too: they stay counted while any lane sample of the group runs
    (`used`).
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, fraction: float = EXPRESS_FRACTION):
        """
        Args:
            num_blocks: the cache's blocks.
            block_size: tokens per block.
            max_num_seqs: most sequences a step computes.
            fraction: the share of the blocks the lane may hold at once (0: the lane is closed, as before it was
                built; `rollout-bench fairness` measures against that).
        """
        opened = fraction > 0
        self.capacity = max(1, int(num_blocks * fraction)) if opened else 0
        self.seats = max(1, int(max_num_seqs * EXPRESS_SEQ_FRACTION)) if opened else 0  # slots past a full set
        self.block_size = block_size
        self.num_blocks = num_blocks

    def used(self, running: Iterable[Request]) -> int:
        """The blocks the lane's running samples may hold (the sum of their shares), a lane leader's samples not yet
        forked counted too (`fork_share` each): a prompt chunked over several steps forks them only at its end, and
        their shares, left out meanwhile, would let the lane admit past its capacity.

        Invariant: the blocks the lane's running samples hold never exceed this sum (so never the lane's capacity).
        The forks hold their leader's full prompt blocks, which only the leader's share counts: a leader that ends
        (or is preempted) first takes its share away while they still hold those blocks, and the lane would admit
        past its capacity by as many. So a group's full prompt blocks count once while any of its lane forks runs
        without its lane leader, until the last of them leaves.

        Args:
            running: the running requests.
        """
        block_size = self.block_size
        total = 0
        led: set[str] = set()  # groups whose lane leader runs (its share counts their prompt's full blocks)
        orphaned: dict[str, int] = {}  # groups with running lane forks: their prompt's full blocks
        for request in running:
            if request.express_blocks:
                total += request.express_blocks + request.num_forks * fork_share(request, block_size)
                if request.sample_index == 0:
                    led.add(request.group_id)
                else:
                    orphaned[request.group_id] = request.num_prompt_tokens // block_size
        return total + sum(blocks for group, blocks in orphaned.items() if group not in led)

    @staticmethod
    def sequences(running: Iterable[Request]) -> int:
        """The sequences of the lane's running samples (a leader's unforked samples included).

        Args:
            running: the running requests.
        """
        return sum(1 + request.num_forks for request in running if request.express_blocks)

    def eligible(self, request: Request) -> bool:
        """Whether `request` may take the lane at all: its whole life fits in the lane, and it has sampled nothing yet
        (a preempted sample comes back through the queue: through the lane it would be readmitted at once, into the
        very shortage that preempted it, and preempted again).

        Args:
            request: a waiting request.
        """
        return request.num_output_tokens == 0 and life_blocks(request, self.block_size) <= self.capacity

    def closes_behind(self, request: Request) -> bool:
        """Whether the lane closes behind `request`, refused: one whose life needs more than the cache less the
        lane's share may only be admitted once nothing runs (an empty cache always admits), and short requests
        passing it one after another would keep something running for ever.

        Args:
            request: a waiting request the admission gate refused.
        """
        return life_blocks(request, self.block_size) > self.num_blocks - self.capacity

    def took(self, request: Request) -> None:
        """`request` was admitted through the lane: it carries its share (its forks get theirs when they fork).

        Args:
            request: the admitted request.
        """
        request.express_blocks = life_blocks(request, self.block_size) - request.num_forks * fork_share(
            request, self.block_size
        )

"""Who holds each device KV block, so that each request knows how many blocks it holds alone.

`Request.num_own_blocks` is the number of its blocks whose ref count is 1: the blocks its end gives back. Admission
with known lengths (`future_peak`) reads it for every running request whenever a request waits, so it is kept up to
date here at every ref-count change, in O(1) each, rather than counted over the block tables (linear in the blocks
held: 15 ms a step at 1,024 requests of 8k tokens).

Invariants (the block manager calls `add` after raising a block's ref count, `remove` after lowering it):
- a block with ref count 1 has its holder in `sole`, and is counted in that holder's `num_own_blocks`;
- a block with ref count 2 or more has all of its holders in `shared` (keyed by `id`), and counts for none of them;
- a free block is in neither.
Never imports torch.
"""

from __future__ import annotations

from rollout.engine.requests.request import Request


class BlockHolders:
    """The holders of every held device block, and each request's `num_own_blocks`."""

    def __init__(self, num_blocks: int):
        """
        Args:
            num_blocks: device KV blocks.
        """
        self.sole: list[Request | None] = [None] * num_blocks
        self.shared: dict[int, dict[int, Request]] = {}

    def add(self, block: int, request: Request, ref_count: int) -> None:
        """`request` took `block`, whose ref count is now `ref_count`.

        Args:
            block: the device block.
            request: its new holder.
            ref_count: the block's ref count after the holder was added.
        """
        if ref_count == 1:
            self.sole[block] = request
            request.num_own_blocks += 1
        elif ref_count == 2:  # its first holder shares it from now on
            first = self.sole[block]
            assert first is not None and first is not request, f"block {block} has no single holder to share it with"
            self.sole[block] = None
            first.num_own_blocks -= 1
            self.shared[block] = {id(first): first, id(request): request}
        else:
            self.shared[block][id(request)] = request

    def remove(self, block: int, request: Request, ref_count: int) -> None:
        """`request` gave back `block`, whose ref count is now `ref_count`.

        Args:
            block: the device block.
            request: the holder that let it go.
            ref_count: the block's ref count after the holder was removed.
        """
        if ref_count == 0:
            self.sole[block] = None
            request.num_own_blocks -= 1
            return
        holders = self.shared[block]
        del holders[id(request)]
        if ref_count == 1:  # the holder left keeps it alone
            (last,) = holders.values()
            del self.shared[block]
            self.sole[block] = last
            last.num_own_blocks += 1

    def check_empty(self) -> None:
        """Raise AssertionError unless no block has a holder (every block free)."""
        held = [block for block, holder in enumerate(self.sole) if holder is not None]
        assert not held and not self.shared, f"blocks with holders left: {(held + list(self.shared))[:16]}"

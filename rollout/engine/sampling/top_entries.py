"""A row's most likely entries (top log-probs), in one order whatever else is computed with it.

`torch.topk` orders equal values as its kernel happens to (differently for another k, another number of rows, another
device), and a bf16 model's logits tie often, as do the -inf entries of a truncated distribution. So the entries of a
row that asked for n of them would depend on the widest request of its step. Here each score is made into a unique
int64 key, its float's bits turned into an order-preserving integer and the token id below them (lower ids first among
equal scores), and the keys' topk is one well-defined list: its first n entries are the row's n most likely, by score,
then by token id, whatever the width.
"""

from __future__ import annotations

import torch

_LOW_BITS = 0x7FFFFFFF


def top_entries(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest entries of each row of `scores`, ties taken in increasing column order: (values, columns),
    both (rows, width), from the largest.

    Args:
        scores: (rows, columns) fp32, bf16 or fp16 scores without NaN (log-probs or logits; -inf allowed).
        width: entries per row, at most the number of columns.
    """
    # fp32 is exact for bf16 and fp16 values; + 0.0 makes -0.0 +0.0 (equal scores, equal keys).
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)
    # fp32 bits as an integer that increases with the float: a negative float's magnitude bits are flipped.
    ordered = torch.where(bits < 0, bits ^ _LOW_BITS, bits).to(torch.int64)
    columns = scores.shape[1]
    descending_column = torch.arange(columns - 1, -1, -1, device=scores.device)  # lower columns rank higher
    keys = ordered * (1 << 32) + descending_column  # |ordered| < 2^31: no overflow
    where = keys.topk(width, dim=-1).indices
    return scores.gather(1, where), where

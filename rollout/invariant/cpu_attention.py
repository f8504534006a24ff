"""The batch-invariant attention's arithmetic in PyTorch (`attend_in_torch`): the CPU's path, and the backward of the
GPU kernel's (`attention.py` says what is invariant and why).

On the CPU an fp32 matmul computes each output element from its row and its column alone, in an order that depends
on the reduction's length only, whatever the numbers of rows (`matmul.MIN_ROWS` or more) and of columns (two or
more), for reductions of up to `K_CHUNK`; and a product computed as `A @ B` or as `(B.T @ A.T).T` gets the same
bits (measured on this machine's MKL, 1 to 3 threads, reductions of 64 to 256). So each product is laid out with
its many side as the rows:

- the scores: keys on the rows and the queries of the heads sharing a key head on the columns when there are few
  of those (a decode step: no query tile), queries on the rows when there are `MIN_ROWS` or more (a prefill chunk,
  a trainer's sequence: then the scores come out queries by keys, as the softmax wants them, with no transposing
  copy). A head_dim over `K_CHUNK` is reduced in slices added in order;
- each key block's weighted values: (head_dim, `KEY_BLOCK`) x (`KEY_BLOCK`, queries) with few queries, (queries,
  `KEY_BLOCK`) x (`KEY_BLOCK`, head_dim) with many. The blocks' results (and their weights' totals) are added one
  after the other in float64, rounded once, as torch's CPU `cumsum` adds them: one call instead of a loop.

Everything is laid out key head first, (kv_heads, batch, ...): the engine gathers its keys so from the cache
(`paged._gather_heads`, one pass), and every product is then one batched matmul over contiguous matrices. The
softmax runs queries by keys, each block's sum over its contiguous `KEY_BLOCK` weights.
"""

from __future__ import annotations

import torch

from rollout.invariant.matmul import K_CHUNK, MIN_ROWS

KEY_BLOCK = 64
EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, just above fp32's smallest normal number
HIDDEN_SCORE = 3e38  # subtracted from a hidden key's score (finite: a row that sees nothing gets weights 0 x finite)


def attend_in_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    start: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Batch-invariant attention in PyTorch (module docstring; `attention.attend_invariant` for the arguments, here
    with `scaling` given). Keys and values laid out key head first underneath ((B, Hkv, L, D) views of (Hkv, B, L, D)
    tensors, as `paged._gather_heads` gives them) are read where they are when `start` is None and L a whole number
    of key blocks."""
    dtype = query.dtype
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    aligned = -(-keys // KEY_BLOCK) * KEY_BLOCK
    blocks = aligned // KEY_BLOCK

    if start is None and keys == aligned:  # key head first, in fp32 (in place when they are so already)
        key, value = (t.transpose(0, 1).float().contiguous() for t in (key, value))
    elif start is None:  # every row's keys start at 0: copied once, in fp32, whole blocks (zeros after the keys)
        allowed = torch.nn.functional.pad(allowed, (0, aligned - keys))
        key, value = _in_blocks(key, aligned), _in_blocks(value, aligned)
    else:  # each row's keys from its first one, in whole blocks (the end masked)
        index = start[:, None] + torch.arange(aligned, device=query.device)[None, :]
        inside = index < keys
        index = index.clamp(max=keys - 1)
        gather = index[None, :, :, None].expand(kv_heads, batch, aligned, head_dim)
        key, value = (t.float().transpose(0, 1).gather(2, gather) for t in (key, value))
        allowed = allowed.gather(3, index[:, None, None, :].expand(batch, 1, queries, aligned))
        allowed = allowed & inside[:, None, None, :]

    query = query.float().unflatten(1, (kv_heads, group)).transpose(0, 1)  # one copy below, key head first
    query = query.reshape(kv_heads, batch, group * queries, head_dim)
    if group * queries == 1:  # one column takes a matrix-vector kernel: the query twice, as two heads
        query, group = query.expand(kv_heads, batch, 2, head_dim), 2
    columns = group * queries
    wide = columns >= MIN_ROWS
    scores = _scores(query.contiguous(), key, wide).view(kv_heads, batch, group, queries, blocks, KEY_BLOCK)
    # Masks as float arithmetic (boolean masked_fill / where run 20-30x slower than an add on the CPU): a hidden
    # key's score sinks below every seen one (x + 0 is x exactly), and its weight is multiplied by exactly 0.
    seen = allowed.to(torch.float32).view(1, batch, 1, queries, blocks, KEY_BLOCK)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        scores = scores * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + (seen - 1.0) * HIDDEN_SCORE
        peak = scores.amax(dim=(4, 5), keepdim=True)  # a maximum is exact in any order
        # Below EXP_FLOOR exp gives denormals, which the CPU computes dozens of times slower: exp(EXP_FLOOR) instead
        # (off by < 2e-38, against a row total of at least 1).
        weights = torch.exp((scores - peak).clamp(min=EXP_FLOOR)) * seen
    else:  # the same operations in place: each new tensor of this size costs its page faults
        scores.mul_(scaling)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores.add_((seen - 1.0) * HIDDEN_SCORE)
        peak = scores.amax(dim=(4, 5), keepdim=True)
        weights = scores.sub_(peak).clamp_(min=EXP_FLOOR).exp_().mul_(seen)
    # Each block's total, then the blocks' totals added in order (`cumsum`: one after the other, in float64).
    totals = weights.sum(dim=-1)  # (kv_heads, batch, group, queries, blocks)
    out = _weighted_values(weights.view(kv_heads, batch, columns, aligned), value, wide)
    total = totals.cumsum(-1)[..., -1].reshape(kv_heads, batch, columns, 1)
    # A query that sees no key has weights 0, so an output of exactly 0: 0 / tiny keeps it 0 (and no 0 / 0). With a
    # gradient, its row is cut off explicitly: 1 / tiny would overflow a scaled loss's gradient to Inf.
    out = out / total.clamp(min=torch.finfo(torch.float32).tiny)
    if out.requires_grad:
        out = torch.where(total > 0, out, 0.0)
    out = out.view(kv_heads, batch, group, queries, head_dim)[:, :, : heads // kv_heads].transpose(0, 1)
    return out.reshape(batch, heads, queries, head_dim).to(dtype)


def _scores(query: torch.Tensor, key: torch.Tensor, wide: bool) -> torch.Tensor:
    """Every query's score with every key, queries by keys: (kv_heads, batch, columns, aligned), a new contiguous
    tensor; one product per `K_CHUNK` slice of head_dim, added in order.

    Args:
        query: (kv_heads, batch, columns, head_dim), the queries of the heads sharing a key head side by side.
        key: (kv_heads, batch, aligned, head_dim).
        wide: queries on the products' rows (module docstring), else keys.
    """
    scores = None
    for first in range(0, query.shape[-1], K_CHUNK):
        q, k = query[..., first : first + K_CHUNK], key[..., first : first + K_CHUNK]
        product = torch.matmul(q, k.transpose(-1, -2)) if wide else torch.matmul(k, q.transpose(-1, -2))
        scores = product if scores is None else scores + product
    return scores if wide else scores.transpose(-1, -2).contiguous()


def _weighted_values(weights: torch.Tensor, value: torch.Tensor, wide: bool) -> torch.Tensor:
    """Each query's weighted sum of values, key block by key block, the blocks added in order: (kv_heads, batch,
    columns, head_dim).

    Args:
        weights: (kv_heads, batch, columns, aligned), contiguous.
        value: (kv_heads, batch, aligned, head_dim), contiguous.
        wide: queries on the products' rows (module docstring), else the head_dim.
    """
    kv_heads, batch, columns, aligned = weights.shape
    head_dim, blocks = value.shape[-1], aligned // KEY_BLOCK
    if wide:  # per block (queries, KEY_BLOCK) x (KEY_BLOCK, head_dim), both read in place; added as cumsum adds
        out = None
        for first in range(0, aligned, KEY_BLOCK):
            part = torch.matmul(weights[..., first : first + KEY_BLOCK], value[..., first : first + KEY_BLOCK, :])
            out = part.double() if out is None else out.add_(part)
        return out.float()
    # Per block (head_dim, KEY_BLOCK) x (KEY_BLOCK, columns): the few columns' weights copied keys first (small).
    w = weights.view(kv_heads, batch, columns, blocks, KEY_BLOCK).permute(0, 1, 3, 4, 2).contiguous()
    value_t = value.view(kv_heads, batch, blocks, KEY_BLOCK, head_dim).transpose(-1, -2)
    parts = torch.matmul(value_t, w)  # (kv_heads, batch, blocks, head_dim, columns)
    return parts.cumsum(2)[:, :, -1].transpose(-1, -2)


def _in_blocks(keys: torch.Tensor, aligned: int) -> torch.Tensor:
    """(batch, kv_heads, n, head_dim) keys or values of any layout and dtype as one contiguous fp32 tensor laid out
    key head first, (kv_heads, batch, aligned, head_dim), zeros after the n: the matmuls then take it without a copy
    of their own."""
    batch, kv_heads, n, head_dim = keys.shape
    out = keys.new_empty((kv_heads, batch, aligned, head_dim), dtype=torch.float32)
    out[:, :, :n].copy_(keys.transpose(0, 1))
    out[:, :, n:].zero_()
    return out

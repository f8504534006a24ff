"""The batch-invariant attention's arithmetic in PyTorch (`attend_in_torch`): the CPU's path, and the backward of the
GPU kernel's (`attention.py` says what is invariant and why).

On the CPU an fp32 matmul computes each output element from its row and its column alone, in an order that depends
on the reduction's length only, whatever the numbers of rows and columns and threads, as long as the rows are a
multiple of `MIN_QUERY_ROWS` (the machine's bound, checked) and the reduction is at most 64 long (measured on three
machines' MKL: scores over head_dim slices of 64 against query rows and 64 to 4096 keys, weighted values over a
`KEY_BLOCK` of keys against head dims of 16 to 256, either operand transposed or strided; on an AMD EPYC (AVX-512),
multiples of 4 rows up to 1,024 with 1 to 32 threads gave the bits of one thread; on an Intel Sapphire Rapids too).
Other row counts may take other kernels, and which ones depends on the processor and the thread count: on an Intel
machine 1 and 2 rows did; on the AMD EPYC 1 to 3 rows with any thread count, also 5-7 and 9-11 with two threads and
17-19 and 25-27 with sixteen. So every product is laid out the same way, queries on the rows, zero rows added up to
a multiple of `MIN_QUERY_ROWS` (the linears' rule):

- the scores: (queries, `SCORE_SLICE`) x (`SCORE_SLICE`, keys) per slice of head_dim, the slices added in order. A
  decode step (one query per head) takes the queries of the heads sharing a key head as its rows (the zero rows'
  results dropped before the softmax);
- each key block's weighted values: (queries, `KEY_BLOCK`) x (`KEY_BLOCK`, head_dim). The blocks' results (and
  their weights' totals) are added one after the other in float64, rounded once, as torch's CPU `cumsum` adds them.

Everything is laid out key head first, (kv_heads, batch, ...): the engine gathers its keys so from the cache
(`paged._gather_heads`, one pass), and every product is then one batched matmul. The softmax runs queries by keys,
each block's sum over its contiguous `KEY_BLOCK` weights.
"""

from __future__ import annotations

import torch

from rollout.invariant.matmul import ROW_MULTIPLES

KEY_BLOCK = 64
SCORE_SLICE = 64  # head_dim reduced in slices of this length
# Every product has a multiple of this many rows, the machine's bound as the linears' `matmul.MIN_ROWS` is (it says
# why), raised by `cpu_check.check_cpu_products` to the first of `ROW_MULTIPLES` under which the attention holds.
MIN_QUERY_ROWS = ROW_MULTIPLES[0]
FEW_ROWS = 64  # up to this many rows, a step's weighted values are one product over every key block (faster)
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
    row_multiple: int | None = None,
) -> torch.Tensor:
    """Batch-invariant attention in PyTorch (module docstring; `attention.attend_invariant` for the arguments, here
    with `scaling` given, and `row_multiple` the products' row multiple, by default `MIN_QUERY_ROWS`: the check tries
    others). Keys and values laid out key head first underneath ((B, Hkv, L, D) views of (Hkv, B, L, D) tensors, as
    `paged._gather_heads` gives them) are read where they are when `start` is None and L a whole number of key
    blocks."""
    if torch.is_autocast_enabled(query.device.type):  # every product in fp32, as the engine computes them
        with torch.autocast(query.device.type, enabled=False):
            return attend_in_torch(query, key, value, allowed, start, scaling, softcap, row_multiple)
    multiple = MIN_QUERY_ROWS if row_multiple is None else row_multiple
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

    query = query.float().unflatten(1, (kv_heads, group)).transpose(0, 1)  # (kv_heads, batch, group, queries, D)
    rows = group * queries
    scores = _scores(query.reshape(kv_heads, batch, rows, head_dim), key, multiple)
    scores = scores.view(kv_heads, batch, group, queries, blocks, KEY_BLOCK)
    seen = allowed.to(torch.float32).view(1, batch, 1, queries, blocks, KEY_BLOCK)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        scores = scores * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + (seen - 1.0) * HIDDEN_SCORE
        peak = scores.amax(dim=(4, 5), keepdim=True)  # a maximum is exact in any order
        weights = torch.exp((scores - peak).clamp(min=EXP_FLOOR)) * seen
    else:
        scores.mul_(scaling)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores.add_((seen - 1.0) * HIDDEN_SCORE)
        peak = scores.amax(dim=(4, 5), keepdim=True)
        weights = scores.sub_(peak).clamp_(min=EXP_FLOOR).exp_().mul_(seen)
    totals = weights.sum(dim=-1).view(kv_heads, batch, rows, blocks)
    out = _weighted_values(weights.view(kv_heads, batch, rows, aligned), value, multiple)
    total = totals.cumsum(-1)[..., -1:]
    out = out / total.clamp(min=torch.finfo(torch.float32).tiny)
    if out.requires_grad:
        out = torch.where(total > 0, out, 0.0)
    # Laid out (batch, queries, heads, head_dim) underneath, as both callers want it: one copy.
    out = out.view(kv_heads, batch, group, queries, head_dim).permute(1, 3, 0, 2, 4)
    return out.reshape(batch, queries, heads, head_dim).to(dtype).transpose(1, 2)


def _scores(query: torch.Tensor, key: torch.Tensor, multiple: int) -> torch.Tensor:
    """Every query's score with every key: (kv_heads, batch, rows, aligned); one product per `SCORE_SLICE` of
    head_dim, added in order, of a multiple of `multiple` rows (zero rows added, their scores dropped: the softmax
    then runs over the real rows only)."""
    rows = query.shape[2]
    if rows % multiple:
        return _scores(torch.nn.functional.pad(query, (0, 0, 0, (-rows) % multiple)), key, multiple)[:, :, :rows]
    scores = None
    for first in range(0, query.shape[-1], SCORE_SLICE):
        product = torch.matmul(
            query[..., first : first + SCORE_SLICE], key[..., first : first + SCORE_SLICE].transpose(-1, -2)
        )
        scores = product if scores is None else scores + product
    return scores


def _weighted_values(weights: torch.Tensor, value: torch.Tensor, multiple: int) -> torch.Tensor:
    """Each query's weighted sum of values, key block by key block, the blocks added in order in float64:
    (kv_heads, batch, rows, head_dim); products of a multiple of `multiple` rows (zero rows added, dropped)."""
    kv_heads, batch, rows, aligned = weights.shape
    blocks = aligned // KEY_BLOCK
    padded = torch.nn.functional.pad(weights, (0, 0, 0, (-rows) % multiple)) if rows % multiple else weights
    if rows <= FEW_ROWS:  # one product over every block (the same products), the blocks added as cumsum adds them
        w = padded.view(kv_heads, batch, padded.shape[2], blocks, KEY_BLOCK).transpose(2, 3)
        parts = torch.matmul(w, value.view(kv_heads, batch, blocks, KEY_BLOCK, -1))[:, :, :, :rows]
        return parts.cumsum(2)[:, :, -1]
    out = None
    for first in range(0, aligned, KEY_BLOCK):
        part = torch.matmul(padded[..., first : first + KEY_BLOCK], value[..., first : first + KEY_BLOCK, :])
        out = part.double() if out is None else out.add_(part)
    return out[:, :, :rows].float()


def _in_blocks(keys: torch.Tensor, aligned: int) -> torch.Tensor:
    """(batch, kv_heads, n, head_dim) keys or values of any layout and dtype as one contiguous fp32 tensor laid out
    key head first, (kv_heads, batch, aligned, head_dim), zeros after the n: the matmuls then take it without a copy
    of their own."""
    batch, kv_heads, n, head_dim = keys.shape
    out = keys.new_empty((kv_heads, batch, aligned, head_dim), dtype=torch.float32)
    out[:, :, :n].copy_(keys.transpose(0, 1))
    out[:, :, n:].zero_()
    return out

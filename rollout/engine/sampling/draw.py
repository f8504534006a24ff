"""The draw, last in the sampling pipeline (`Sampler`): one uniform number per row from a counter-based hash of (request
seed, sample index, position), mixed on the device, then the first column whose cumulative probability reaches it
(inverse CDF, in token id order). A completion never depends on the rest of the batch, on preemption, or on any RNG
state, and drawing needs no host round trip.

`sample_from` walks a whole row at once (an fp64 cumsum over all its columns: the sampler gives it a row's top
candidates); `sample_blocked` walks the same CDF in blocks (fp64 block sums, then a cumsum over one block), so whole
rows need no vocabulary-wide fp64 cumsum. Both draw the same column from the same probabilities, up to fp64 rounding.
"""

from __future__ import annotations

import torch

BLOCK = 1024  # columns per block of `sample_blocked`


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch multiplies by (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_MIX_1, _MIX_2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def uniform_from_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per seed (float64, 52 random bits), a pure function of the seed: SplitMix64's
    finaliser (products wrap around 64 bits, as its arithmetic modulo 2^64 wants), in a dozen element-wise ops.

    Args:
        seeds: (rows,) int64 seeds (already mixed from request seed, sample index and position).
    """
    z = (seeds ^ _shift_right(seeds, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 12).to(torch.float64) + 0.5) * 2.0**-52


def sample_from(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Draw one column per row of `probs` (rows need not be normalised) with the uniform of its seed: the first
    column whose cumulative probability reaches u * total, so a zero-probability column is never drawn.

    Args:
        probs: (rows, columns) non-negative weights.
        seeds: (rows,) int64 seeds.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform_from_seeds(seeds).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample_blocked(probs: torch.Tensor, seeds: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`sample_from` without an fp64 cumsum over whole rows: the block holding the target is found from the
    blocks' fp64 sums, then the column within that block's fp64 cumsum. A zero-probability column is never drawn
    (the target is kept within the chosen block's mass, and the first column reaching it carries some).

    Args:
        probs: (rows, columns) non-negative weights.
        seeds: (rows,) int64 seeds.
        block: columns per block.
    """
    width = probs.shape[1]
    if width <= block:
        return sample_from(probs, seeds)
    full = width // block * block
    # unfold: the full blocks as a view (slicing off a ragged last block and reshaping would copy the rows).
    sums = probs.unfold(1, block, block).sum(dim=-1, dtype=torch.float64)
    if full < width:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
    cdf = sums.cumsum(dim=-1)
    target = uniform_from_seeds(seeds).unsqueeze(1) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)  # (rows, 1)
    before = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    columns = chosen * block + torch.arange(block, device=probs.device)
    inside = columns < width
    values = probs.gather(1, columns.clamp(max=width - 1)).to(torch.float64).masked_fill_(~inside, 0.0)
    within = values.cumsum(dim=-1)
    # Rounding may put the target a hair past the block's own cumsum: keep it within (on its last weighted column).
    rest = torch.minimum(target - before, within[:, -1:])
    found = torch.searchsorted(within, rest).clamp_(max=block - 1)
    return (chosen * block + found).squeeze(1).clamp_(max=width - 1)

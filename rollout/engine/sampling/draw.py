"""The draw, last in the sampling pipeline (`Sampler`): one uniform number per row from a counter-based hash of (request
seed, sample index, position), then the first column whose cumulative probability reaches it (inverse CDF, in token
id order). A completion never depends on the rest of the batch, on preemption, or on any RNG state, and drawing needs
no host round trip.

The uniform numbers are made on the host (`uniforms`, numpy), where the rows' positions are, and reach the device with
the step's slot indices, in the same copy: on a GPU a dozen element-wise kernels per step were a dozen launches.

`sample_from` walks a whole row at once (an fp64 cumsum over all its columns: the sampler gives it a row's top
candidates); `sample_blocked` walks the same CDF in blocks (fp64 block sums, then a cumsum over one block), so whole
rows need no vocabulary-wide fp64 cumsum. Both draw the same column from the same probabilities, up to fp64 rounding.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 1024  # columns per block of `sample_blocked`

# SplitMix64's constants (Steele, Lea and Flood; Vigna's splitmix64.c): the increment between consecutive positions
# (2^64 / golden ratio, odd) and the finaliser's two multipliers.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(seed_bases: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """SplitMix64's output for each row: its finaliser applied to seed_base + position * gamma (modulo 2^64), i.e. the
    position-th number of a SplitMix64 stream started at seed_base. numpy's uint64 arithmetic wraps as the algorithm
    wants.

    Args:
        seed_bases: (rows,) the samples' 63-bit stream ids (`slots.stream_seed`), uint64 or non-negative int64.
        positions: (rows,) non-negative positions of the tokens drawn.
    """
    z = seed_bases.astype(np.uint64) + positions.astype(np.uint64) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def uniforms(seed_bases: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uniform number in (0, 1) per row (float64, the top 52 bits of `splitmix64`, centred in their interval), a
    pure function of (seed base, position).

    Args:
        seed_bases: (rows,) the samples' stream ids.
        positions: (rows,) the positions of the tokens drawn.
    """
    return ((splitmix64(seed_bases, positions) >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one column per row of `probs` (rows need not be normalised) with its uniform number u: the first column
    whose cumulative probability reaches u * total, so a zero-probability column is never drawn.

    Args:
        probs: (rows, columns) non-negative weights.
        uniform: (rows,) float64 numbers in (0, 1) (`uniforms`), on the device of `probs`.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample_blocked(probs: torch.Tensor, uniform: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`sample_from` without an fp64 cumsum over whole rows: the block holding the target is found from the
    blocks' fp64 sums, then the column within that block's fp64 cumsum. A zero-probability column is never drawn
    (the target is kept within the chosen block's mass, and the first column reaching it carries some).

    Args:
        probs: (rows, columns) non-negative weights.
        uniform: (rows,) float64 numbers in (0, 1) (`uniforms`), on the device of `probs`.
        block: columns per block.
    """
    width = probs.shape[1]
    if width <= block:
        return sample_from(probs, uniform)
    full = width // block * block
    # unfold: the full blocks as a view (slicing off a ragged last block and reshaping would copy the rows).
    sums = probs.unfold(1, block, block).sum(dim=-1, dtype=torch.float64)
    if full < width:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
    cdf = sums.cumsum(dim=-1)
    target = uniform.unsqueeze(1) * cdf[:, -1:]
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

"""What a worker's KV cache holds, said at start in the terms a rollout is planned in: tokens, and how many
sequences of a given length fit at once (a GRPO round of n samples x its longest output needs that many)."""

from __future__ import annotations

# Sequence lengths the start-up line spells out (besides the model's whole context).
PLANNING_LENGTHS = (1024, 4096, 16384)


def cache_capacity(num_blocks: int, block_size: int, max_model_len: int) -> str:
    """One sentence: the cache's tokens, and how many sequences of the context and of `PLANNING_LENGTHS` tokens fit
    in it at once (more running than that are preempted, or wait).

    Args:
        num_blocks: KV blocks.
        block_size: tokens per block.
        max_model_len: the longest sequence the engine runs.
    """
    tokens = num_blocks * block_size
    lengths = sorted({length for length in PLANNING_LENGTHS if length < max_model_len} | {max_model_len})
    counts = [num_blocks // -(-length // block_size) for length in lengths]
    fits = [f"{count} of {length}" for count, length in zip(counts, lengths)]
    fits[0] = fits[0].replace(" of ", " sequence of " if counts[0] == 1 else " sequences of ", 1)
    rest = "".join(f", {fit}" for fit in fits[1:])
    short = "; not one sequence of the whole context fits: a request that needs one ends with an error"
    return f"the KV cache holds {tokens} tokens: at once {fits[0]} tokens{rest} (the context){short * (not counts[-1])}"

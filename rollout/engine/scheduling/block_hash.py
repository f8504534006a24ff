"""The prefix cache's key for one full KV block: a hash of the block's tokens, of what it chains from (the previous
block's hash, or the LoRA adapter for a first block) and of the policy version behind its KV.

A cache hit compares nothing but this hash, so two different prefixes with one hash would share KV: a request
would be answered from another prompt's keys and values. Python's `hash()` of a tuple of integers is the same in
every process and easy to invert (its rounds are bijections), so a client could compute, off-line, a block whose
hash is the one of another client's prefix (a common system prompt), and its KV would then serve that client
(vLLM's CVE-2025-25183 is the same flaw). `hash()` of bytes is SipHash under the process's secret key
(`PYTHONHASHSEED`, random by default): without the key no one can aim at a hash, and blind collisions of 64 bits
are too rare to matter. Packing a block's tokens into bytes costs more than hashing a tuple: 1.0 against 0.2 us
for a 16-token block on the 2-core development machine; each block is hashed once (a request memoises its prefix's
hashes), so a 32k-token prompt pays ~2 ms once.
"""

from __future__ import annotations

import struct
from functools import lru_cache

# What a block chains from: the previous block's hash, ("adapter", name) for an adapter's first block, None for the
# base model's first block.
Parent = int | tuple[str, str] | None


@lru_cache(maxsize=8)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")


def prefix_block_hash(parent: Parent, tokens: list[int], version: int) -> int:
    """The prefix-cache key of a full block: a keyed hash of `parent`, `tokens` and `version`, each written so that
    no two different triples give the same bytes.

    Args:
        parent: the previous block's hash, ("adapter", name) for an adapter's first block, None for the base
            model's first block.
        tokens: the block's token ids.
        version: the policy version behind its KV.
    """
    if parent is None:
        head = b"b"
    elif isinstance(parent, int):
        head = b"h" + parent.to_bytes(8, "little", signed=True)
    else:
        name = parent[1].encode("utf-8", "surrogatepass")
        head = b"a" + len(name).to_bytes(4, "little") + name
    return hash(b"%d:%s%s" % (version, head, _packer(len(tokens)).pack(*tokens)))

"""The prefix hash chain: a full block's identity is hash(parent block's hash, its token ids).

Two blocks get the same hash only when every token before them and in them is the same, so equal
hashes mean equal KV for one model. What else changes a block's KV — the model's weights, the KV
dtype, the block size — is fixed for a block pool (one per cache of one process: the engine's, a
controller pipeline's, a simulated pipeline's), so it is not hashed; nor are positions, which the
chain implies. A hash never leaves the process that computed it. BLAKE2b (128 bits) rather than
Python's `hash`: a collision would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = b""  # the parent of a sequence's first block


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], num_blocks: int, block_size: int) -> list[bytes]:
    """Extend `hashes` (the chain of `token_ids`' first full blocks, computed so far) in place to its
    first `num_blocks` blocks (at most the full blocks of `token_ids`); returns it."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    for i in range(len(hashes), num_blocks):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes

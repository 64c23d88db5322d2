"""Fixed-size KV block allocator: hands out block ids from a free list and takes them back."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Raised by `allocate` when fewer blocks are free than asked for; nothing is allocated then."""


class BlockAllocator:
    """Owns block ids 0..num_blocks-1. Every id is either free or owned by exactly one caller.

    Contract: `allocate(n)` returns n distinct ids that were free (all-or-nothing, raises
    `OutOfBlocks` otherwise); `free(ids)` returns owned ids to the pool and rejects double frees
    and ids it never handed out. Freed blocks are reused oldest-freed first (FIFO).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"freeing blocks that are not allocated (or twice): {sorted(set(bad) or ids)}")
        self._used.difference_update(ids)
        self._free.extend(ids)

    def check(self) -> None:
        """Internal invariant: free and used partition the id space."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate id in free list"
        assert not (free & self._used), "id both free and used"
        assert len(free) + len(self._used) == self.num_blocks, "block ids leaked"

"""Grows and releases per-request block tables against one `BlockAllocator`."""

from __future__ import annotations

from kvflow.kv.block_allocator import BlockAllocator


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Block-table bookkeeping for a paged cache.

    Contract: `ensure(table, n)` extends `table` (a request's list of block ids, owned by the
    request) so it can hold n tokens and returns True, or changes nothing and returns False when
    not enough blocks are free; `release(table)` frees every block and empties the table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def missing_blocks(self, table: list[int], num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(table))

    def can_ensure(self, table: list[int], num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.missing_blocks(table, num_tokens))

    def ensure(self, table: list[int], num_tokens: int) -> bool:
        need = self.missing_blocks(table, num_tokens)
        if not self.allocator.can_allocate(need):
            return False
        table.extend(self.allocator.allocate(need))
        return True

    def release(self, table: list[int]) -> None:
        self.allocator.free(table)
        table.clear()

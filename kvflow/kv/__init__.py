"""KV cache: paged storage, block allocation and per-request block tables."""

from kvflow.kv.block_allocator import BlockAllocator, OutOfBlocks
from kvflow.kv.cache import KVCache, KVLayout

__all__ = ["BlockAllocator", "OutOfBlocks", "KVCache", "KVLayout"]

"""KV cache: paged storage, the reference-counted block pool with its prefix cache, block tables."""

from kvflow.kv.block_pool import BlockPool, OutOfBlocks
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.kv.manager import KVCacheManager, PrefixCacheStats, PrefixHit

__all__ = ["BlockPool", "OutOfBlocks", "KVCache", "KVCacheManager", "KVLayout", "PrefixCacheStats", "PrefixHit"]

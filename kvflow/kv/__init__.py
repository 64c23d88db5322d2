"""KV cache: paged storage, the reference-counted block pool with its prefix cache, block tables.

The tensor side (`KVCache`, `KVLayout`: torch) loads when first named, so that what only counts
blocks (the scheduler in the simulator and the planner) does not import torch through here."""

from kvflow.kv.block_pool import BlockPool, OutOfBlocks
from kvflow.kv.manager import KVCacheManager, PrefixCacheStats, PrefixHit

__all__ = ["BlockPool", "OutOfBlocks", "KVCache", "KVCacheManager", "KVLayout", "PrefixCacheStats", "PrefixHit"]


def __getattr__(name: str):
    if name in ("KVCache", "KVLayout"):
        from kvflow.kv import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'kvflow.kv' has no attribute {name!r}")

"""Grows and releases per-request block tables against one `BlockPool`, reusing cached prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.kv.block_pool import BlockPool
from kvflow.kv.prefix_hash import extend_hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks holding a request's first `num_tokens` tokens (`blocks`, in order), found
    by a lookup of `queried` tokens."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    queried: int = 0


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of one pool's prefix cache (tier "device"): tokens looked up at admission, tokens
    found cached, cached blocks evicted to make room."""

    queries: int
    hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block-table bookkeeping for a paged cache, with prefix caching (`prefix_caching=True`).

    Contract: `match(tokens, hashes, max_tokens)` finds the longest cached prefix of `tokens` in
    whole blocks, at most `max_tokens` tokens (`hashes` is the caller's memo of the tokens' hash
    chain, extended as needed); it takes nothing. `ensure(table, n, hit)` makes `table` (a request's
    list of block ids, owned by the request; empty when `hit` is given) hold n tokens — first the
    hit's blocks, shared with their other holders, then new ones — and returns True, or changes
    nothing and returns False when not enough blocks are free or evictable. `cache_blocks` registers
    the full blocks of a table whose KV is now computed, so later requests can hit them. `release`
    drops the table's references (full blocks stay cached until evicted) and empties it.
    `reset_prefix_cache` forgets every cached prefix (the KV behind them was lost).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks)
        self.queries = 0
        self.hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new tokens: free plus cached-and-unreferenced (evictable)."""
        return self.pool.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, self.pool.evictions)

    def match(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int) -> PrefixHit:
        if not self.prefix_caching:
            return NO_HIT
        blocks: list[int] = []
        for i in range(max(0, max_tokens) // self.block_size):
            extend_hashes(hashes, token_ids, i + 1, self.block_size)  # lazily: stop at the first miss
            b = self.pool.by_hash.get(hashes[i]) if i < len(hashes) else None
            if b is None:
                break
            blocks.append(b)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size, len(token_ids))

    def missing_blocks(self, table: list[int], num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(table))

    def can_ensure(self, table: list[int], num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        new = max(0, blocks_for(num_tokens, self.block_size) - len(table) - len(hit.blocks))
        return new + self.pool.num_unreferenced(hit.blocks) <= self.pool.num_free

    def ensure(self, table: list[int], num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        if hit.blocks and table:
            raise ValueError("a prefix hit starts a table: the table must be empty")
        if not self.can_ensure(table, num_tokens, hit):
            return False
        if hit.queried:
            self.queries += hit.queried
            self.hits += hit.num_tokens
        self.pool.take(hit.blocks)
        table.extend(hit.blocks)
        table.extend(self.pool.allocate(self.missing_blocks(table, num_tokens)))
        return True

    def cache_blocks(self, table: Sequence[int], token_ids: Sequence[int], hashes: list[bytes], start: int,
                     end: int) -> None:
        """Tokens [start, end) of the table's sequence now have their KV computed: register the full
        blocks among them (blocks already registered, or whose content another block holds, stay as they are)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        extend_hashes(hashes, token_ids, end // bs, bs)
        for i in range(start // bs, min(end // bs, len(table))):
            self.pool.insert(table[i], hashes[i])

    def release(self, table: list[int]) -> None:
        self.pool.free(reversed(table))  # a prefix's last blocks are evicted before its first
        table.clear()

    def reset_prefix_cache(self) -> None:
        self.pool.clear()

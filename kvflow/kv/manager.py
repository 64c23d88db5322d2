"""Grows and releases per-request block tables against one `BlockPool`, reusing cached prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.kv.block_pool import BlockPool, anonymous_blocks
from kvflow.kv.prefix_hash import extend_hashes
from kvflow.kv.tiers import TierPlan, TierPool, TierStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks holding a request's first `num_tokens` tokens, found by a lookup of
    `queried` tokens: `blocks` are in the device pool; `promote` are (position in the table, host
    slot, hash) of blocks held by the host tier, copied back into new device blocks on admission."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    queried: int = 0
    promote: tuple[tuple[int, int, bytes], ...] = ()


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
    """Block-table bookkeeping for a paged cache, with prefix caching (`prefix_caching=True`) over
    up to three tiers: the device pool, and optionally a host pool and a disk pool below it
    (`kvflow.kv.tiers`; the copies they need are collected in a `TierPlan`, `take_plan`).

    Contract: `match(tokens, hashes, max_tokens)` finds the longest cached prefix of `tokens` in
    whole blocks, at most `max_tokens` tokens (`hashes` is the caller's memo of the tokens' hash
    chain, extended as needed); it takes nothing. `ensure(table, n, hit)` makes `table` (a request's
    list of block ids, owned by the request; empty when `hit` is given) hold n tokens — first the
    hit's blocks, shared with their other holders, then new ones — and returns True, or changes
    nothing and returns False when not enough blocks are free or evictable. `cache_blocks` registers
    the full blocks of a table whose KV is now computed, so later requests can hit them. `release`
    drops the table's references (full blocks stay cached until evicted) and empties it.
    `reset_prefix_cache` forgets every cached prefix (the KV behind them was lost).

    Tiers: a cached device block that is evicted is demoted to the host pool (its LRU victim to the
    disk pool); `match` continues the hash chain in the host pool, and `ensure` promotes those blocks
    into new device blocks; `prefetch` loads a waiting request's blocks found on disk, or held by another
    instance, into the host pool (True while such a load is pending: admit it once it has returned,
    `loads_done`). `held_blocks` / `still_held`: the device blocks another instance may pull.

    `block_ids=False` (no prefix caching): tables only count their blocks (`BlockPool`'s anonymous
    mode), for an executor that never addresses KV (the simulator).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 host: TierPool | None = None, disk: TierPool | None = None, block_ids: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if disk is not None and host is None:
            raise ValueError("a disk tier needs a host tier above it")
        if not block_ids and prefix_caching:
            raise ValueError("prefix caching names its blocks: block_ids=False needs prefix_caching=False")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, anonymous=not block_ids)
        self.host = host if prefix_caching else None
        self.disk = disk if prefix_caching else None
        self.plan = TierPlan()
        self._from_disk: set[int] = set()  # host slots loaded from disk not yet hit (their hits count as disk's)
        if self.host is not None:
            self.pool.on_evict = self._demote
        self.queries = 0
        self.hits = 0
        self.pulled = [0, 0]  # blocks pulled from other instances: [failed (not held there, or lost), loaded]

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
        """The device tier's counters (`hits`: tokens of prefix hits served by device blocks)."""
        return PrefixCacheStats(self.queries, self.hits - self._tier_hits("host") - self._tier_hits("disk"), self.pool.evictions)

    def _tier_hits(self, name: str) -> int:
        t = getattr(self, name)
        return t.hits if t is not None else 0

    def tier_stats(self) -> dict[str, PrefixCacheStats]:
        """Per tier ("device", "host", "disk" — those that exist): tokens looked up, tokens hit in it, evictions."""
        out = {"device": self.stats}
        for t in (self.host, self.disk):
            if t is not None:
                out[t.name] = PrefixCacheStats(self.queries, t.hits, t.evictions)
        return out

    def tier_counters(self) -> dict[str, TierStats]:
        return {t.name: t.stats for t in (self.host, self.disk) if t is not None}

    def _chain(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int):
        """(position, hash) of the full blocks of the first `max_tokens` tokens, hashed lazily."""
        for i in range(max(0, max_tokens) // self.block_size):
            extend_hashes(hashes, token_ids, i + 1, self.block_size)
            if i >= len(hashes):
                return
            yield i, hashes[i]

    def match(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int) -> PrefixHit:
        if not self.prefix_caching:
            return NO_HIT
        blocks: list[int] = []
        promote: list[tuple[int, int, bytes]] = []
        n = 0
        for i, h in self._chain(token_ids, hashes, max_tokens):  # stop at the first block no tier holds
            b = self.pool.by_hash.get(h)
            if b is not None:
                blocks.append(b)
            else:
                s = self.host.lookup(h) if self.host is not None else None
                if s is None:
                    break
                promote.append((i, s, h))
            n += 1
        return PrefixHit(tuple(blocks), n * self.block_size, len(token_ids), tuple(promote))

    def prefetch(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int, source: str | None = None) -> bool:
        """Plan loads into the host tier of the blocks of a waiting request's prefix that no tier here holds up to
        the first block none holds: from the disk tier, and (`source`: the URL of another instance that computed
        them) pulled from that instance (`kvflow.streaming.kv_pull`), which may no longer hold them (the load then
        fails and they are recomputed). True while a load of its prefix is pending."""
        if self.host is None or (self.disk is None and source is None and not self.host.loading):
            return False  # (nothing to load, and no load in flight it could be waiting for)
        pending = False
        for _, h in self._chain(token_ids, hashes, max_tokens):
            if h in self.pool.by_hash:
                continue
            s = self.host.lookup(h)
            if s is not None:
                self.host.pin(s)  # its own later loads must not evict it (the host tier may be shorter than the chain)
                continue
            if self.host.is_loading(h):
                pending = True
                continue
            f = self.disk.lookup(h) if self.disk is not None else None
            if f is None and source is None:
                break
            got = self._host_alloc(h, loading=True)
            if got is None:  # the host tier is full of this step's blocks: the rest is recomputed
                break
            if f is None:
                self.plan.from_remote.append((source, h, got))
            else:
                self.disk.pin(f)
                self.plan.from_disk.append((f, got))
                self._from_disk.add(got)
            pending = True
        return pending

    def pulls_done(self, ops: Sequence[tuple[str, bytes, int]], failed: Sequence[int]) -> None:
        """An executor finished pulling `ops` (a plan's `from_remote`): the host slots not in `failed` become
        findable; the failed ones (not held by the instance, or it could not be reached) are dropped, to be recomputed."""
        bad = set(failed)
        for _, _, s in ops:
            if self.host is not None and s in self.host.loading:  # (not forgotten meanwhile: a reset)
                self.host.loaded(s, s not in bad)
                self.pulled[s not in bad] += 1

    def loads_done(self, plan: TierPlan) -> None:
        """An executor performed `plan`: its disk -> host loads become findable, or (listed in
        `plan.failed`: corrupted or truncated) are dropped from both tiers, to be recomputed."""
        if not plan.from_disk:
            return  # (most batches: no disk loads)
        failed = set(plan.failed)
        for f, s in plan.from_disk:
            if self.host is None or s not in self.host.loading:
                continue  # forgotten meanwhile (reset)
            self.host.loaded(s, s not in failed)
            if s in failed:
                self._from_disk.discard(s)
                if self.disk is not None and f in self.disk.hash_of:
                    self.disk.drop(f)
                    self.disk.rejected += 1

    def take_plan(self) -> TierPlan:
        """The copies planned since the last call (attached to the batch being formed); the slots
        they use become reusable by later steps' copies, which executors perform after these."""
        plan, self.plan = self.plan, TierPlan()
        for t in (self.host, self.disk):
            if t is not None:
                t.unpin_step()
        return plan

    def _host_alloc(self, h: bytes, loading: bool = False) -> int | None:
        """A host slot for hash h; its LRU victim goes to the disk tier (host -> disk) when there is one."""
        got = self.host.alloc(h, loading)
        if got is None:
            return None
        slot, evicted = got
        if evicted is not None:
            self._from_disk.discard(slot)
            if self.disk is not None and evicted not in self.disk.slot_of:
                d = self.disk.alloc(evicted)
                if d is not None:
                    self.plan.to_disk.append((slot, d[0]))
            elif self.disk is not None:
                self.disk.touch(self.disk.slot_of[evicted])
        return slot

    def _demote(self, block: int, h: bytes) -> None:
        """The device pool evicts cached `block`: keep its KV in the host tier (unless held there already)."""
        s = self.host.slot_of.get(h)
        if s is not None:
            self.host.touch(s)
            return
        slot = self._host_alloc(h)
        if slot is not None:
            self.plan.to_host.append((block, slot))

    def held_blocks(self, hashes: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """(index in `hashes`, device block, its generation) of each of `hashes` this pool holds, for a copy made
        outside the owner's thread, which checks each block's generation again afterwards (`BlockPool.generation`)."""
        by_hash, gen = self.pool.by_hash, self.pool.generation
        return [(i, b, gen[b]) for i, h in enumerate(hashes) if (b := by_hash.get(h)) is not None]

    def still_held(self, hashes: Sequence[bytes], held: Sequence[tuple[int, int, int]]) -> list[bool]:
        """For each of `held` (from `held_blocks(hashes)`): whether its block still holds that content, unchanged since."""
        return [self.pool.hash_of.get(b) == hashes[i] and self.pool.generation[b] == g for i, b, g in held]

    def frozen(self, table: list[int]) -> tuple[int, ...]:
        """`tuple(table)`: a table as a batch records it (`ScheduledSeq.new_block_ids`); an anonymous
        pool's is one shared tuple per length (`anonymous_blocks`)."""
        return anonymous_blocks(len(table)) if self.pool.anonymous else tuple(table)

    def missing_blocks(self, table: list[int], num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(table))

    def can_ensure(self, table: list[int], num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        new = -(-num_tokens // self.block_size) - len(table)  # (blocks_for, inline: twice per admission)
        if hit.blocks:
            new = max(0, new - len(hit.blocks)) + self.pool.num_unreferenced(hit.blocks)
        return new <= self.pool.num_free

    def ensure(self, table: list[int], num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        if hit is NO_HIT:  # (no prefix hit: new blocks only; most decode steps need none)
            new = -(-num_tokens // self.block_size) - len(table)
            if new <= 0:
                return True
            if new > self.pool.num_free:
                return False
            self.pool.allocate_to(table, new)
            return True
        if (hit.blocks or hit.promote) and table:
            raise ValueError("a prefix hit starts a table: the table must be empty")
        if not self.can_ensure(table, num_tokens, hit):
            return False
        if hit.queried:
            self.queries += hit.queried
            self.hits += hit.num_tokens
        self.pool.take(hit.blocks)
        if hit.promote:
            for _, s, _ in hit.promote:  # no eviction below may reuse a slot we copy from
                self.host.pin(s)
            fresh = self.pool.allocate(len(hit.promote))
            device = iter(hit.blocks)
            by_pos = {i: (s, h, b) for (i, s, h), b in zip(hit.promote, fresh)}
            for i in range(len(hit.blocks) + len(hit.promote)):
                if i not in by_pos:
                    table.append(next(device))
                    continue
                s, h, b = by_pos[i]
                table.append(b)
                self.plan.to_device.append((s, b))
                self.pool.insert(b, h)
                self.host.touch(s)
                tier = self.disk if s in self._from_disk else self.host
                self._from_disk.discard(s)
                tier.hits += self.block_size
        else:
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
        if start // bs == end // bs and len(hashes) >= end // bs:
            return  # no block filled up (most decode steps)
        extend_hashes(hashes, token_ids, end // bs, bs)
        for i in range(start // bs, min(end // bs, len(table))):
            self.pool.insert(table[i], hashes[i])

    def release(self, table: list[int]) -> None:
        self.release_all((table,))

    def release_all(self, tables: Sequence[list[int]]) -> None:
        """Give back every block of each of `tables` (emptied), in order; a prefix's last blocks are
        evicted before its first (an anonymous pool only counts them)."""
        self.pool.free_tables(tables)
        for table in tables:
            table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix in every tier, and any copy not yet handed to an executor."""
        self.pool.clear()
        for t in (self.host, self.disk):
            if t is not None:
                t.clear()
        self.plan = TierPlan()
        self._from_disk.clear()

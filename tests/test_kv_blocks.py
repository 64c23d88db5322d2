"""Block pool (reference counts, prefix cache, LRU eviction) and block-table manager invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.kv.block_pool import BlockPool, OutOfBlocks
from kvflow.kv.manager import KVCacheManager
from kvflow.kv.prefix_hash import ROOT, extend_hashes, hash_block


def test_allocate_is_all_or_nothing_and_fifo_reuse():
    a = BlockPool(4)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocks, match="asked for 2 KV blocks, 1 of 4 free"):
        a.allocate(2)
    assert a.num_free == 1
    a.free([1, 0])
    assert a.allocate(3) == [3, 1, 0]
    a.check()


def test_double_free_and_foreign_ids_rejected():
    a = BlockPool(3)
    ids = a.allocate(2)
    a.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free(ids[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([7])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([ids[1], ids[1]])
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError, match="no cached prefix"):
        a.take([ids[1]])
    a.check()


def test_shared_block_is_freed_only_by_its_last_holder_then_cached_then_evicted_lru():
    p = BlockPool(4)
    a, b = p.allocate(2)
    assert p.insert(a, b"A") and p.insert(b, b"B")
    assert not p.insert(a, b"X") and p.lookup([b"A", b"B", b"C"]) == [a, b]
    p.take([a])  # a second request hits block a
    p.free([b, a])  # the first one ends: a still held by the second, b cached
    assert p.ref[a] == 1 and p.num_cached == 1 and p.num_free == 3
    p.free([a])
    assert p.num_cached == 2 and p.lookup([b"A", b"B"]) == [a, b]
    # free blocks go first, then cached ones, least recently released first (b, then a)
    assert p.allocate(2) == [2, 3] and p.evictions == 0
    assert p.allocate(1) == [b] and p.lookup([b"A", b"B"]) == [a] and p.evictions == 1
    assert p.allocate(1) == [a] and p.lookup([b"A"]) == [] and p.evictions == 2
    p.check()


def test_clear_forgets_hashes_but_not_references():
    p = BlockPool(3)
    a, b = p.allocate(2)
    p.insert(a, b"A")
    p.insert(b, b"B")
    p.free([b])
    p.clear()
    assert p.lookup([b"A"]) == [] and p.num_cached == 0 and p.num_free == 2 and p.ref[a] == 1
    p.free([a])
    assert p.num_free == 3
    p.check()


def test_hash_chain_depends_on_every_earlier_token():
    h = extend_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 9], 10, 4)
    assert len(h) == 2 and h[0] == hash_block(ROOT, [1, 2, 3, 4]) and h[1] == hash_block(h[0], [5, 6, 7, 8])
    other = extend_hashes([], [0, 2, 3, 4, 5, 6, 7, 8], 2, 4)
    assert other[1] != h[1]  # same second block, different first: a different prefix
    assert extend_hashes(list(h[:1]), [1, 2, 3, 4, 5, 6, 7, 8], 2, 4) == h  # extends a memo


def test_manager_grows_tables_by_block_size():
    m = KVCacheManager(num_blocks=5, block_size=4)
    t: list[int] = []
    assert m.ensure(t, 1) and t == [0]
    assert m.ensure(t, 4) and t == [0]
    assert m.ensure(t, 9) and t == [0, 1, 2]
    other: list[int] = []
    assert not m.ensure(other, 13) and other == []  # needs 4, only 2 free: nothing taken
    assert m.ensure(other, 8) and other == [3, 4]
    m.release(t)
    assert t == [] and m.num_free_blocks == 3


def test_manager_match_counts_a_hit_only_when_it_is_taken_and_needs_room_for_unreferenced_hits():
    m = KVCacheManager(num_blocks=4, block_size=4)
    toks = list(range(10, 22))
    t: list[int] = []
    assert m.ensure(t, 12)
    m.cache_blocks(t, toks, [], 0, 12)
    m.release(t)  # 3 blocks cached, 1 free
    hashes: list[bytes] = []
    hit = m.match(toks + [99], hashes, 12)
    assert hit.blocks == (2, 1, 0)[::-1] and hit.num_tokens == 12 and len(hashes) == 3
    # the hit takes its 3 cached blocks out of the 4 available: 13 tokens need one more block only
    assert m.can_ensure([], 16, hit) and not m.can_ensure([], 17, hit)
    assert m.stats.queries == 0
    mine: list[int] = []
    assert m.ensure(mine, 13, hit) and mine == [0, 1, 2, 3]
    assert (m.stats.queries, m.stats.hits) == (13, 12)
    off = KVCacheManager(4, 4, prefix_caching=False)
    t = []
    off.ensure(t, 12)
    off.cache_blocks(t, toks, [], 0, 12)
    off.release(t)
    assert off.match(toks, [], 12).num_tokens == 0 and off.pool.num_cached == 0


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "hit", "grow", "free", "compute", "clear"]),
                         st.integers(0, 5), st.integers(0, 2), st.integers(1, 24)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_pool_invariants_under_random_allocate_hit_grow_free_evict(ops):
    """Requests (tables) over 3 shared prompt families: references never negative, no block both
    free and referenced, never more blocks in use than the pool has, a block referenced by two
    tables survives until both release it, and a hit always returns the blocks of its own tokens."""
    bs, n = 4, 16
    m = KVCacheManager(num_blocks=n, block_size=bs)
    families = [[f * 100 + i for i in range(48)] for f in range(3)]
    tables: dict[int, tuple[list[int], list[int], list[bytes]]] = {}  # rid -> (table, tokens, hashes)
    content: dict[int, bytes] = {}  # block -> the hash it was computed for (a model of the KV it holds)
    for op, rid, fam, k in ops:
        if op in ("alloc", "hit") and rid not in tables:
            toks = families[fam][:k] + [1000 + rid] * (k % 3)
            hashes: list[bytes] = []
            hit = m.match(toks, hashes, len(toks) - 1) if op == "hit" else m.match(toks, hashes, 0)
            for i, b in enumerate(hit.blocks):
                assert content[b] == hashes[i]  # a hit is the KV of exactly these tokens
            table: list[int] = []
            if m.ensure(table, len(toks), hit):
                tables[rid] = (table, toks, hashes)
            else:
                assert table == []
        elif op == "grow" and rid in tables:
            table, toks, hashes = tables[rid]
            before = list(table)
            toks += [2000 + rid] * k
            if not m.ensure(table, len(toks)):
                assert table == before
                del toks[-k:]
        elif op == "compute" and rid in tables:
            table, toks, hashes = tables[rid]
            m.cache_blocks(table, toks, hashes, 0, len(toks))
            for i in range(len(toks) // bs):
                if m.pool.hash_of.get(table[i]) == hashes[i]:
                    content[table[i]] = hashes[i]
        elif op == "free" and rid in tables:
            m.release(tables.pop(rid)[0])
        elif op == "clear":
            m.reset_prefix_cache()
        m.pool.check()
        held: dict[int, int] = {}
        for table, _, _ in tables.values():
            for b in table:
                held[b] = held.get(b, 0) + 1
        assert all(m.pool.ref[b] == c for b, c in held.items())  # shared blocks: one reference per holder
        assert sum(1 for r in m.pool.ref if r > 0) == len(held) <= n  # the budget
        assert m.num_free_blocks == n - len(held)
    for table, _, _ in list(tables.values()):
        m.release(table)
    assert m.num_free_blocks == n and all(r == 0 for r in m.pool.ref)
    m.pool.check()

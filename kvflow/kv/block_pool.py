"""The KV block pool: reference-counted block ids, with full blocks kept after release as a prefix
cache (by content hash) until the pool needs them back, least recently used first."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence, Sized


ANONYMOUS = 0  # the id every block of an anonymous pool has (tables of such a pool only count blocks)
_RUNS: dict[int, tuple[int, ...]] = {}


def anonymous_blocks(n: int) -> tuple[int, ...]:
    """`n` copies of `ANONYMOUS`, one shared tuple per count (a simulated run's tables are millions
    of such runs of ~100 blocks: extended from, and recorded in batches, without a copy each)."""
    run = _RUNS.get(n)
    if run is None:
        run = _RUNS[n] = (ANONYMOUS,) * n
    return run


class OutOfBlocks(RuntimeError):
    """Raised by `allocate` when fewer blocks are available than asked for; nothing is taken then."""


class BlockPool:
    """Owns block ids 0..num_blocks-1. Each id is, at any time, exactly one of:

    - referenced: `ref[b] > 0` holders (requests sharing it: a block of a cached prefix has one per request);
    - cached: unreferenced but holding a full block whose content hash is registered (`insert`); a
      prefix-cache hit (`lookup` then `take`) references it again; kept until evicted;
    - free: unreferenced and holding nothing anyone can find.

    Contract: `allocate(n)` returns n blocks, each referenced once, taken from the free list first
    (oldest freed first) and then by evicting cached blocks, least recently released first; it is
    all-or-nothing and raises `OutOfBlocks` when fewer than n blocks are free or cached. `free(ids)`
    drops one reference per id (rejecting ids that hold none); a block losing its last reference
    becomes cached if it has a hash, free otherwise. `take(ids)` adds a reference (a hit). `insert`
    registers a referenced block under its hash unless that hash is already registered (the first
    block computed keeps it) or the block has one. `lookup(hashes)` is the longest prefix of `hashes`
    that is registered, as block ids (no side effect). `clear()` forgets every hash (the KV behind
    them was lost): cached blocks become free, referenced ones stay referenced, unfindable.

    `anonymous=True`: blocks are counted, not named, for an executor that never addresses KV and
    caches no prefix (the simulator): `allocate(n)` hands out n copies of `ANONYMOUS` and `free`
    counts what it gets back, so a table costs what its length changes, not one step per block.
    Nothing can be registered, taken or looked up in such a pool.
    """

    def __init__(self, num_blocks: int, anonymous: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.anonymous = anonymous
        self.num_free = num_blocks  # blocks `allocate` can hand out now: free plus evictable cached ones
        self.ref = [] if anonymous else [0] * num_blocks  # (an anonymous pool names no block)
        self.hash_of: dict[int, bytes] = {}  # block -> its content hash (registered blocks only)
        self.by_hash: dict[bytes, int] = {}  # hash -> block
        self._free: deque[int] = deque() if anonymous else deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, LRU first
        self.evictions = 0
        # per block, times it stopped holding its registered content (evicted, or forgotten by `clear`): a reader
        # copying a cached block outside the owner's thread (`kvflow.streaming.kv_pull`) checks it did not change
        self.generation = [] if anonymous else [0] * num_blocks
        # called with (block, hash) as a cached block is evicted, before anyone can write it (lower tiers)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def num_unreferenced(self, ids: Iterable[int]) -> int:
        """How many of `ids` (a hit) are cached and unreferenced: referencing them takes them out of `num_free`."""
        return sum(1 for b in ids if self.ref[b] == 0)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} of {self.num_blocks} free")
        self.num_free -= n
        if self.anonymous:
            return [ANONYMOUS] * n
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)  # evict the least recently released
                h = self.hash_of.pop(b)
                del self.by_hash[h]
                self.evictions += 1
                self.generation[b] += 1
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self.ref[b] = 1
            ids.append(b)
        return ids

    def allocate_to(self, table: list[int], n: int) -> None:
        """`table.extend(allocate(n))` (an anonymous pool's blocks come from `anonymous_blocks`)."""
        if self.anonymous and 0 <= n <= self.num_free:
            self.num_free -= n
            table += _RUNS.get(n) or anonymous_blocks(n)
        else:
            table.extend(self.allocate(n))

    def take(self, ids: Sequence[int]) -> None:
        """One more reference to each of `ids` (registered blocks from `lookup`)."""
        if self.anonymous and ids:
            raise ValueError("an anonymous pool holds no cached prefix")
        for b in ids:
            if b not in self.hash_of:
                raise ValueError(f"block {b} holds no cached prefix")
        for b in ids:
            if self.ref[b] == 0:
                del self._cached[b]
                self.num_free -= 1
            self.ref[b] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference to each of `ids`. Pass a request's table last block first, so that the
        end of a prefix is evicted before its beginning (a later block is useless without the earlier)."""
        if self.anonymous:  # (a table of copies of ANONYMOUS: only its length counts)
            self._count_back(len(ids) if ids.__class__ is list or isinstance(ids, Sized) else sum(1 for _ in ids))
            return
        ids = list(ids)
        counts: dict[int, int] = {}
        for b in ids:
            counts[b] = counts.get(b, 0) + 1
        bad = [b for b, c in counts.items() if not (isinstance(b, int) and 0 <= b < self.num_blocks) or self.ref[b] < c]
        if bad:
            raise ValueError(f"freeing blocks that are not allocated (or more often than referenced): {sorted(bad)}")
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.num_free += 1
                if b in self.hash_of:
                    self._cached[b] = None  # most recently released: evicted last
                else:
                    self._free.append(b)

    def free_tables(self, tables: Iterable[list[int]]) -> None:
        """`free` of each of `tables` in turn, each last block first (requests' tables released
        together: an anonymous pool counts them at once)."""
        if self.anonymous:
            self._count_back(sum(map(len, tables)))
            return
        for t in tables:
            self.free(reversed(t))

    def _count_back(self, n: int) -> None:
        """An anonymous pool gets `n` blocks back."""
        if n > self.num_blocks - self.num_free:
            raise ValueError(f"freeing {n} blocks, {self.num_blocks - self.num_free} are allocated")
        self.num_free += n

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, block: int, h: bytes) -> bool:
        """Register referenced `block` as holding the content `h`; False if `h` or `block` already is."""
        if self.anonymous:
            raise ValueError("an anonymous pool registers no prefix")
        if self.ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        return True

    def clear(self) -> None:
        for b in self.hash_of:
            self.generation[b] += 1
        self.by_hash.clear()
        self.hash_of.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def check(self) -> None:
        """Internal invariants: the three states partition the ids and the hash maps agree."""
        if self.anonymous:
            assert 0 <= self.num_free <= self.num_blocks, "free count out of range"
            return
        assert self.num_free == len(self._free) + len(self._cached), "free count disagrees with the lists"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate id in the free list"
        assert not (free & cached), "id both free and cached"
        assert all(r >= 0 for r in self.ref), "negative reference count"
        referenced = {b for b, r in enumerate(self.ref) if r > 0}
        assert not (referenced & (free | cached)), "id both referenced and free or cached"
        assert len(free) + len(cached) + len(referenced) == self.num_blocks, "block ids leaked"
        assert all(b in self.hash_of for b in cached), "a cached block without a hash"
        assert not (free & set(self.hash_of)), "a free block still registered"
        assert {b: h for h, b in self.by_hash.items()} == self.hash_of, "hash maps disagree"

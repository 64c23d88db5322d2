"""The lower KV tiers of the prefix cache, scheduler side: a bounded host pool and a bounded disk pool
of block-sized slots, each found by a block's content hash, and the copies (`TierPlan`) an executor
performs before a step's forward. Which bytes move is decided here; the executor side
(`kvflow.streaming.tier_store`) only carries the plan out.

A full block evicted from the device pool is demoted to the host pool (device -> host); a block
evicted from the host pool is demoted to the disk pool (host -> disk). A waiting request whose hash
chain continues in the host pool is admitted with those blocks promoted (host -> device); one whose
chain continues on disk has them loaded into the host pool first (disk -> host, verified by checksum
at the executor; `TierPlan.failed` reports rejected blocks, which are dropped and recomputed). A request
whose prompt another instance computed (a prefill instance of the router's P/D pools) has the blocks no
tier here holds pulled from that instance into the host pool (`from_remote`; engine only): in the background,
while steps go on, the results coming back through `KVCacheManager.pulls_done`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Room for a chunk file's prefix and header, per slot and per pipeline stage, that a disk
# slot's byte budget counts beside the KV payload (asserted by the executor when it writes a slot).
DISK_SLOT_OVERHEAD = 1024

PHASES = ("to_disk", "to_host", "from_disk", "to_device")


@dataclass(slots=True)
class TierPlan:
    """One step's copies between tiers, performed by the executor before the step's forward, in the
    order of `PHASES` (a slot is used by at most one op of a step, so this order is always safe):
    to_disk [(host slot, disk slot)], to_host [(device block, host slot)], from_disk [(disk slot,
    host slot)], to_device [(host slot, device block)]; and from_remote [(instance URL, block hash,
    host slot)], pulled from another instance in the background (an engine's plan only: never sent to
    a worker; reported later, `KVCacheManager.pulls_done`). `failed`: host slots of `from_disk` whose
    block was rejected on reading (checksum, truncation) — filled in by the executor."""

    to_disk: list[tuple[int, int]] = field(default_factory=list)
    to_host: list[tuple[int, int]] = field(default_factory=list)
    from_disk: list[tuple[int, int]] = field(default_factory=list)
    to_device: list[tuple[int, int]] = field(default_factory=list)
    from_remote: list[tuple[str, bytes, int]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.to_disk or self.to_host or self.from_disk or self.to_device or self.from_remote)

    def to_wire(self) -> list[list[int]]:
        """[phase index, src, dst] triples (msgpack-friendly)."""
        assert not self.from_remote, "pulls from another instance are an engine's, never a worker's"
        return [[i, a, b] for i, ph in enumerate(PHASES) for a, b in getattr(self, ph)]

    @classmethod
    def from_wire(cls, ops: list[list[int]]) -> "TierPlan":
        plan = cls()
        for i, a, b in ops:
            getattr(plan, PHASES[i]).append((a, b))
        return plan


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier: tokens of prefix hits served from it, blocks stored into it, blocks
    evicted from it, blocks rejected on reading (disk)."""

    hits: int = 0
    stores: int = 0
    evictions: int = 0
    rejected: int = 0


class TierPool:
    """`num_slots` slots of `slot_bytes` each within `budget_bytes` (asserted: never exceeded). Each
    slot is free, or holds a block by hash: valid (findable, LRU-evictable unless pinned) or loading
    (pinned, not findable until `loaded`). Pins: a slot an op of the step being planned reads or
    writes (released by `unpin_step`), and a slot loading from disk (until its result is known).

    Contract: `alloc(h)` gives a pinned slot for hash h (h must not be held), taking a free slot or
    evicting the least recently used unpinned valid one (returned with its hash, for the caller to
    demote), or None when every slot is pinned. `lookup(h)` is the valid slot holding h or None.
    `drop(slot)` forgets a slot (a rejected load). `clear()` forgets everything (the KV was lost)."""

    def __init__(self, name: str, num_slots: int, slot_bytes: int, budget_bytes: int) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"{name} tier needs positive slots and slot bytes ({num_slots}, {slot_bytes})")
        if num_slots * slot_bytes > budget_bytes:
            raise ValueError(f"{name} tier: {num_slots} slots of {slot_bytes} B exceed the budget {budget_bytes} B")
        self.name, self.num_slots, self.slot_bytes, self.budget_bytes = name, num_slots, slot_bytes, budget_bytes
        self.slot_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, None] = OrderedDict()  # valid slots, least recently used first
        self.pins: dict[int, int] = {}
        self._step_pins: list[int] = []
        self.loading: set[int] = set()
        self.hits = self.stores = self.evictions = self.rejected = 0

    @property
    def bytes_used(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes

    @property
    def stats(self) -> TierStats:
        return TierStats(self.hits, self.stores, self.evictions, self.rejected)

    def lookup(self, h: bytes) -> int | None:
        s = self.slot_of.get(h)
        return None if s is None or s in self.loading else s

    def is_loading(self, h: bytes) -> bool:
        s = self.slot_of.get(h)
        return s is not None and s in self.loading

    def pin(self, slot: int) -> None:
        """Pin `slot` for the step being planned (no other op may reuse it before the plan is taken)."""
        self.pins[slot] = self.pins.get(slot, 0) + 1
        self._step_pins.append(slot)

    def _unpin(self, slot: int) -> None:
        if slot not in self.pins:  # dropped meanwhile
            return
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]

    def unpin_step(self) -> None:
        for s in self._step_pins:
            self._unpin(s)
        self._step_pins.clear()

    def touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def alloc(self, h: bytes, loading: bool = False) -> tuple[int, bytes | None] | None:
        assert h not in self.slot_of, f"{self.name} tier already holds this hash"
        evicted = None
        if self._free:
            slot = self._free.popleft()
        else:
            slot = next((s for s in self._lru if s not in self.pins), None)
            if slot is None:
                return None
            del self._lru[slot]
            evicted = self.hash_of.pop(slot)
            del self.slot_of[evicted]
            self.evictions += 1
        self.slot_of[h], self.hash_of[slot] = slot, h
        self._lru[slot] = None
        self.pin(slot)
        if loading:
            self.loading.add(slot)
            self.pins[slot] += 1  # held until `loaded`, beyond this step
        else:
            self.stores += 1
        assert self.bytes_used <= self.budget_bytes, f"{self.name} tier over its byte budget"
        return slot, evicted

    def loaded(self, slot: int, ok: bool) -> None:
        """A load into `slot` finished: it becomes findable, or (rejected) is dropped."""
        self.loading.discard(slot)
        self._unpin(slot)
        if ok:
            self.stores += 1
        else:
            self.rejected += 1
            self.drop(slot)

    def drop(self, slot: int) -> None:
        h = self.hash_of.pop(slot, None)
        if h is None:
            return
        del self.slot_of[h]
        self._lru.pop(slot, None)
        self.loading.discard(slot)
        self.pins.pop(slot, None)
        self._free.append(slot)

    def clear(self) -> None:
        self.slot_of.clear()
        self.hash_of.clear()
        self._lru.clear()
        self.pins.clear()
        self._step_pins.clear()
        self.loading.clear()
        self._free = deque(range(self.num_slots))

    def check(self) -> None:
        """Internal invariants: free and held slots partition the ids, maps agree, budget kept."""
        free, held = set(self._free), set(self.hash_of)
        assert len(free) == len(self._free), "duplicate slot in the free list"
        assert not free & held, "slot both free and holding a block"
        assert free | held == set(range(self.num_slots)), "slots leaked"
        assert set(self._lru) == held, "LRU order and held slots disagree"
        assert {s: h for h, s in self.slot_of.items()} == self.hash_of, "hash maps disagree"
        assert self.loading <= held and all(s in self.pins for s in self.loading), "a loading slot not held or not pinned"
        assert all(s in held for s in self.pins) and all(c > 0 for c in self.pins.values()), "pin on a free slot"
        assert self.bytes_used <= self.budget_bytes, "over the byte budget"


@dataclass(frozen=True)
class TierSizes:
    """Slots of the host and disk tiers for a model whose KV block takes `block_bytes` over all layers."""

    host_slots: int = 0
    disk_slots: int = 0
    block_bytes: int = 0
    host_budget: int = 0
    disk_budget: int = 0
    stages: int = 1

    @classmethod
    def from_budgets(cls, host_bytes: int, disk_bytes: int, block_bytes: int, stages: int = 1) -> "TierSizes":
        disk_slot = block_bytes + DISK_SLOT_OVERHEAD * stages
        return cls(host_bytes // block_bytes, disk_bytes // disk_slot, block_bytes, host_bytes, disk_bytes, stages)

    def pools(self) -> tuple[TierPool | None, TierPool | None]:
        host = TierPool("host", self.host_slots, self.block_bytes, self.host_budget) if self.host_slots else None
        disk = None
        if self.disk_slots and host is not None:  # the disk tier sits below the host tier
            disk = TierPool("disk", self.disk_slots, self.block_bytes + DISK_SLOT_OVERHEAD * self.stages, self.disk_budget)
        return host, disk

"""A stage's replication (`kvflow.worker.replication.Replicator`) on real components: the replica
store's shared-memory segment written in place, and the fallback to increments over TCP into the
store's KV port when the segment cannot be mapped."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.controller import Controller
from kvflow.controller.replica_store import ReplicaStore
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.sched.request import Request
from kvflow.sched.sampling import SamplingParams
from kvflow.streaming.region import token_slots
from kvflow.wire import Replicated, Route, SeqStep, Step, WorkerError, new_secret
from kvflow.worker.replication import Replicator, held_replica

LAYOUT = KVLayout(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, layer_start=2, layer_end=4, dtype=torch.bfloat16)
TABLES = {"a": (3, 7, 1), "b": (9, 2)}  # block tables (tokens: a 10, b 6 after the two steps)


def filled_cache() -> KVCache:
    cache = KVCache(LAYOUT)
    cache.data.copy_(torch.randn(LAYOUT.shape).to(LAYOUT.dtype))
    return cache


def steps() -> list[Step]:
    """A first step with whole tables (new to the pipeline: tokens from 0), then a decode step."""
    first = Step(0, 0, [SeqStep("a", 0, 9, list(TABLES["a"]), full_table=True), SeqStep("b", 0, 5, list(TABLES["b"]), full_table=True)])
    second = Step(0, 1, [SeqStep("a", 9, 1, []), SeqStep("b", 5, 1, [])])
    return [first, second]


def replica_rows(cache: KVCache, rid: str, n: int) -> torch.Tensor:
    slots = torch.tensor(token_slots(TABLES[rid], 0, n, LAYOUT.block_size), dtype=torch.long)
    return cache.data.view(LAYOUT.num_layers, 2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:, :, slots]


@pytest.fixture
def store():
    s = ReplicaStore("127.0.0.1", new_secret())
    yield s
    s.close()


def test_the_store_segment_is_written_in_place_and_reported(store):
    addr = store.add("token", 0, LAYOUT)
    assert store.segment("token", 0), "the store keeps its replica in shared memory"
    cache, reports = filled_cache(), []
    rep = Replicator(cache, 0, "token-0", Route("", replica_to=addr, replica_shm=store.segment("token", 0)), 0,
                     b"", reports.append)
    assert rep.replica is not None and rep.sender is None
    for msg in steps():
        rep.step(msg, TABLES)
    rep.drain()  # (landed already unless KVFLOW_TEST_REPLICATION_THREAD put them on the thread)
    replica = store.caches[("token", 0)]
    for rid, n in (("a", 10), ("b", 6)):
        assert torch.equal(replica_rows(replica, rid, n), replica_rows(cache, rid, n))
    assert reports == [Replicated("token-0", ["a", "b"], [0, 0], [9, 5], 0, 0), Replicated("token-0", ["a", "b"], [9, 5], [10, 6], 0, 0)]
    assert store.nbytes == 0 and rep.nbytes == 16 * LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2
    untouched = torch.ones(LAYOUT.num_blocks, dtype=torch.bool)
    untouched[[b for t in TABLES.values() for b in t]] = False
    assert not replica.data[:, :, untouched].any(), "only the steps' slots are written"


def test_copies_landed_by_the_background_thread_are_the_inline_ones_in_order(store):
    """The CUDA way (`background`: the step only packs; a thread writes the segment and reports),
    run on the CPU: after `drain`, the replica and the reports are those of the inline copies, and
    more steps than there are staging buffers queue up (back-pressure) without reordering."""
    segment = (store.add("colocated", 0, LAYOUT, port=False), store.segment("colocated", 0))[1]
    cache, reports = filled_cache(), []
    rep = Replicator(cache, 0, "colocated-0", Route("", replica_shm=segment), 3, b"", reports.append, background=True)
    assert rep._thread is not None
    held = held_replica(LAYOUT, segment, "colocated-1")
    try:
        first, second = steps()
        rep.step(first, TABLES)
        for n in range(6):  # six one-token steps, a: tokens 9..14 (its third block, then more blocks), b: 5..10
            tables = {"a": TABLES["a"] + (11, 12), "b": TABLES["b"] + (13, 14)}
            rep.step(Step(3, 1 + n, [SeqStep("a", 9 + n, 1, []), SeqStep("b", 5 + n, 1, [])]), tables)
        rep.drain()
        assert [(r.starts, r.ends, r.epoch) for r in reports] == [([0, 0], [9, 5], 0)] + [
            ([9 + n, 5 + n], [10 + n, 6 + n], 3) for n in range(6)]
        full = {"a": TABLES["a"] + (11, 12), "b": TABLES["b"] + (13, 14)}
        for rid, n in (("a", 15), ("b", 11)):
            slots = torch.tensor(token_slots(full[rid], 0, n, LAYOUT.block_size), dtype=torch.long)
            view = lambda c: c.data.view(LAYOUT.num_layers, 2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:, :, slots]  # noqa: E731
            assert torch.equal(view(held), view(cache))
        assert rep.nbytes == (14 + 6 * 2) * LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2
    finally:
        rep.close()
    assert rep._thread is None


def test_a_copy_that_fails_on_the_background_thread_is_reported_as_the_workers_error(store):
    """A write the landing thread cannot make (here: a replica smaller than the cache's slots) is not
    swallowed: it reaches the controller as a `WorkerError` of the step's epoch, and the thread goes on."""
    segment = (store.add("colocated", 0, LAYOUT, port=False), store.segment("colocated", 0))[1]
    cache, reports = filled_cache(), []
    rep = Replicator(cache, 0, "colocated-0", Route("", replica_shm=segment), 5, b"", reports.append, background=True)
    good = rep.replica
    try:
        rep.replica = KVCache(KVLayout(2, 4, 2, 8, 2, 4, torch.bfloat16))  # slots up to 8 only
        first, second = steps()
        rep.step(first, TABLES)
        rep.drain()
        assert len(reports) == 1 and isinstance(reports[0], WorkerError) and reports[0].epoch == 0
        assert "replicating in place failed" in reports[0].message and reports[0].name == "colocated-0"
        rep.replica = good
        rep.step(second, TABLES)
        rep.drain()
        assert reports[1] == Replicated("colocated-0", ["a", "b"], [9, 5], [10, 6], 0, 0)
    finally:
        rep.close()


def test_a_landing_thread_that_hangs_fails_the_step_instead_of_hanging_it(store, monkeypatch):
    """The thread stuck (here in its report, as on a blocked controller socket): the copies queued
    behind it keep both staging buffers, and the next step fails after LAND_TIMEOUT_S with an error
    the worker reports, rather than waiting forever."""
    import threading

    monkeypatch.setattr(Replicator, "LAND_TIMEOUT_S", 0.3)
    segment = (store.add("colocated", 0, LAYOUT, port=False), store.segment("colocated", 0))[1]
    stuck, reports = threading.Event(), []

    def report(msg):
        reports.append(msg)
        stuck.wait(30)

    rep = Replicator(filled_cache(), 0, "colocated-0", Route("", replica_shm=segment), 0, b"", report, background=True)
    try:
        first, second = steps()
        rep.step(first, TABLES)  # landed, then stuck in its report
        rep.step(second, TABLES)  # queued, holding one buffer
        rep.step(second, TABLES)  # queued, holding the other
        with pytest.raises(RuntimeError, match="no replica copy landed in 0.3 s"):
            rep.step(second, TABLES)
        assert len(reports) == 1
    finally:
        stuck.set()
        rep.close()
    assert len(reports) == 3  # (the queued copies landed once it went on)


@pytest.mark.parametrize("segment", ["kvflow-replica-none-such", "other-size"])
def test_a_segment_it_cannot_map_falls_back_to_the_kv_port(store, segment):
    secret = store.secret
    addr = store.add("token", 0, LAYOUT)
    if segment == "other-size":  # a segment of another layout's size (e.g. a stale route)
        store.add("token", 1, KVLayout(2, 4, 2, 8, 0, 1, torch.bfloat16))
        segment = store.segment("token", 1)
    cache, reports = filled_cache(), []
    rep = Replicator(cache, 0, "token-0", Route("", replica_to=addr, replica_shm=segment), 0, secret, reports.append)
    assert rep.replica is None and rep.sender is not None
    try:
        for msg in steps():
            rep.step(msg, TABLES)
        rep.sender.finish()  # acknowledged: written into the store's cache
    finally:
        rep.close()
    deadline = time.monotonic() + 30
    while len(store.events) < 2:  # (queued by the receiving thread after the write)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [e[2:] for e in store.events] == [(["a", "b"], [(0, 9), (0, 5)]), (["a", "b"], [(9, 10), (5, 6)])]
    assert reports == [] and store.nbytes > 0
    for rid, n in (("a", 10), ("b", 6)):
        assert torch.equal(replica_rows(store.caches[("token", 0)], rid, n), replica_rows(cache, rid, n))


def test_a_ring_holder_maps_the_segment_its_previous_stage_writes_in_place(store):
    """Ring replication on one host: the store creates the segment (no KV port of its own), the
    holder maps it as the replica it keeps, and the stage it replicates writes into it in place."""
    assert store.add("colocated", 0, LAYOUT, port=False) == ""
    segment = store.segment("colocated", 0)
    held = held_replica(LAYOUT, segment, "colocated-1")
    assert held.shared and not held_replica(LAYOUT, "", "colocated-1").shared
    assert not held_replica(LAYOUT, "kvflow-replica-none-such", "colocated-1").shared  # (then it keeps its own)
    cache, reports = filled_cache(), []
    rep = Replicator(cache, 0, "colocated-0", Route("", replica_to="tcp://127.0.0.1:9", replica_shm=segment), 0, b"",
                     reports.append)
    for msg in steps():
        rep.step(msg, TABLES)
    rep.drain()
    for rid, n in (("a", 10), ("b", 6)):
        assert torch.equal(replica_rows(held, rid, n), replica_rows(cache, rid, n))
    assert [r.stage for r in reports] == [0, 0] and store.nbytes == 0


def test_the_controller_drops_an_in_place_report_of_a_step_a_recovery_voided(tiny_ckpt_dir):
    """A worker writing in place learns of a recovery only after the step it is in: its report of that
    step (an older epoch) must not move the watermark (the request may be recomputed in new blocks)."""
    ctrl = Controller(ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=64, block_size=4),
                                    mode="colocated", depth=1))
    try:
        p, name = ctrl.pipelines[0], ctrl.pipelines[0].stages[0].name
        ctrl.reqs["r"] = Request("r", [1, 2, 3], SamplingParams())
        ctrl.epoch = 2
        ctrl.handle(Replicated(name, ["r"], [0], [3], 0, 1), None)
        assert p.watermark.get(0, {}).get("r", 0) == 0
        ctrl.handle(Replicated(name, ["r"], [0], [3], 0, 2), None)
        assert p.watermark[0]["r"] == 3
    finally:
        ctrl.shutdown_blocking()


def test_a_replica_dev_shm_cannot_hold_is_not_put_there(store):
    """A segment's memory is reserved when it is made: one larger than /dev/shm's room is refused at
    once (the replica then travels over TCP) instead of a SIGBUS at the first write beyond it."""
    st = os.statvfs("/dev/shm")
    block = LAYOUT.num_layers * 2 * LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2
    huge = KVLayout(st.f_bavail * st.f_frsize // block + 1024, 4, 2, 8, 2, 4, torch.bfloat16)
    store.add("colocated", 0, huge, port=False)
    assert store.segment("colocated", 0) == ""
    store.add("colocated", 1, LAYOUT, port=False)
    assert store.segment("colocated", 1)

"""The prefix cache's host and disk tiers: property tests of the pools and of the copies the manager
plans (every promoted block holds the right KV once the plan ran, in any request / release / evict /
load-failure sequence, and no tier exceeds its budget), the executor side's verified disk reads, and
the same tokens with the tiers on and off in every mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.config import EngineConfig
from kvflow.kv.cache import KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.kv.prefix_hash import extend_hashes
from kvflow.kv.tiers import DISK_SLOT_OVERHEAD, TierPlan, TierPool, TierSizes
from kvflow.streaming.tier_store import TierStore

from conftest import tiny_cache, tiny_config
from tier_waves import TBS, WAVES, engine_waves, wave_params

BS = 2
BASES = [[10 + b * 20 + i for i in range(12)] for b in range(3)]  # three prompts sharing nothing


class Executor:
    """What an executor does with a plan, on symbolic contents (the hash a slot's KV belongs to)."""

    def __init__(self) -> None:
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.disk: dict[int, object] = {}

    def apply(self, plan: TierPlan, corrupt: set[int]) -> list[int]:
        for s, f in plan.to_disk:
            self.disk[f] = self.host.get(s)
        for b, s in plan.to_host:
            self.host[s] = self.device.get(b)
        failed = []
        for f, s in plan.from_disk:
            if f in corrupt:
                self.host[s] = "garbage"
                failed.append(s)
            else:
                self.host[s] = self.disk.get(f)
        for s, b in plan.to_device:
            self.device[b] = self.host.get(s)
        return failed


def check_all(kv: KVCacheManager) -> None:
    kv.pool.check()
    for t in (kv.host, kv.disk):
        t.check()
        assert t.bytes_used <= t.budget_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "admit", "release", "step"]), st.integers(0, 2), st.integers(3, 12),
                          st.integers(0, 7)), min_size=1, max_size=60),
       st.sets(st.integers(0, 5), max_size=3))
def test_tiers_keep_budgets_and_refcounts_and_every_hit_holds_its_kv(actions, corrupt):
    host = TierPool("host", 3, 100, 300)
    disk = TierPool("disk", 5, 120, 600)
    kv = KVCacheManager(8, BS, True, host, disk)
    ex = Executor()
    live: dict[int, tuple[list[int], list[int], list[bytes]]] = {}  # id -> (tokens, table, hashes)
    admitted: list[tuple[int, int]] = []  # (id, hit tokens) admitted since the last step
    ids = iter(range(10**6))
    for action, base, n, pick in actions:
        if action == "admit":
            tokens, hashes, table = BASES[base][:n], [], []
            if kv.prefetch(tokens, hashes, n - 1):
                continue  # waits for its loads (the scheduler admits it once they returned)
            hit = kv.match(tokens, hashes, n - 1)
            if kv.ensure(table, n, hit):
                rid = next(ids)
                live[rid] = (tokens, table, hashes)
                admitted.append((rid, hit.num_tokens))
        elif action == "release" and live:
            rid = sorted(live)[pick % len(live)]
            kv.release(live.pop(rid)[1])
            admitted = [(r, h) for r, h in admitted if r != rid]
        elif action == "step":
            plan = kv.take_plan()
            plan.failed = ex.apply(plan, corrupt)
            for rid, hit_tokens in admitted:
                tokens, table, hashes = live[rid]
                for i in range(hit_tokens // BS):  # the hit's blocks hold exactly its KV before the forward
                    assert ex.device[table[i]] == hashes[i], f"block {i} of a hit holds the wrong KV"
                extend_hashes(hashes, tokens, len(tokens) // BS, BS)
                for i in range(hit_tokens // BS, len(tokens) // BS):  # the forward computes the rest
                    ex.device[table[i]] = hashes[i]
                kv.cache_blocks(table, tokens, hashes, hit_tokens, len(tokens))
            admitted = []
            kv.loads_done(plan)
        check_all(kv)
        referenced = {b for _, t, _ in live.values() for b in t}
        assert all(kv.pool.ref[b] > 0 for b in referenced)
        assert sum(kv.pool.ref) == sum(len(t) for _, t, _ in live.values())


def test_a_block_evicted_twice_is_found_on_disk_then_promoted_through_host():
    host = TierPool("host", 2, 1, 2)
    disk = TierPool("disk", 8, 1, 8)
    kv = KVCacheManager(4, BS, True, host, disk)
    a, ha, ta = BASES[0][:5], [], []
    assert kv.ensure(ta, 5, kv.match(a, ha, 4))
    kv.cache_blocks(ta, a, ha, 0, 5)
    kv.release(ta)  # blocks 2, 1, 0 hold a's KV; 0 and 1 full and cached
    kv.take_plan()
    b, hb, tb = BASES[1][:8], [], []
    assert kv.ensure(tb, 8, kv.match(b, hb, 7))  # 4 blocks: a's two cached blocks go to host
    plan = kv.take_plan()
    assert plan.to_host == [(1, 0), (0, 1)]  # evicted least recently released first: a's 2nd block, then its 1st
    kv.cache_blocks(tb, b, hb, 0, 8)
    kv.release(tb)
    c, hc, tc = BASES[2][:8], [], []
    assert kv.ensure(tc, 8, kv.match(c, hc, 7))  # b's blocks go to host, a's to disk
    plan = kv.take_plan()
    assert [h for h in ha[:2] if h in disk.slot_of] == ha[:2] and plan.to_disk
    kv.release(tc)
    again = []
    assert kv.prefetch(a, again, 4)  # a's prefix is only on disk: loaded into host first
    plan = kv.take_plan()
    assert sorted(f for f, _ in plan.from_disk) == sorted(disk.slot_of[h] for h in ha[:2])
    assert kv.match(a, again, 4).num_tokens == 0  # not usable before the load returned
    kv.loads_done(plan)
    hit = kv.match(a, again, 4)
    assert hit.num_tokens == 4 and len(hit.promote) == 2
    t = []
    assert kv.ensure(t, 5, hit)
    plan = kv.take_plan()
    assert [s for s, _ in plan.to_device] == [host.slot_of[ha[0]], host.slot_of[ha[1]]]
    assert kv.tier_stats()["disk"].hits == 4


def test_a_rejected_disk_block_is_dropped_and_its_tokens_recomputed():
    host = TierPool("host", 2, 1, 2)
    disk = TierPool("disk", 8, 1, 8)
    kv = KVCacheManager(4, BS, True, host, disk)
    for base, n in ((0, 5), (1, 8), (2, 8)):  # a's two full blocks end up on disk (host holds 2 per step)
        toks, hs, t = BASES[base][:n], [], []
        assert kv.ensure(t, n, kv.match(toks, hs, n - 1))
        kv.cache_blocks(t, toks, hs, 0, n)
        kv.release(t)
        kv.take_plan()
    a, ha = BASES[0][:5], []
    assert kv.prefetch(a, ha, 4)
    plan = kv.take_plan()
    first = next(s for f, s in plan.from_disk if disk.hash_of[f] == ha[0])
    plan.failed = [first]
    kv.loads_done(plan)
    assert kv.match(a, ha, 4).num_tokens == 0  # the chain breaks at the rejected first block
    assert ha[0] not in disk.slot_of and ha[0] not in host.slot_of and disk.rejected == 1
    check_all(kv)


def test_pool_budget_is_validated():
    with pytest.raises(ValueError, match="exceed the budget"):
        TierPool("host", 3, 100, 299)
    sizes = TierSizes.from_budgets(1000, 5000, 100, stages=2)
    assert sizes.host_slots == 10 and sizes.disk_slots == 5000 // (100 + 2 * DISK_SLOT_OVERHEAD)
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineConfig(disk_kv_bytes=10)


# ---------------------------------------------------------------------------------- executor side
def filled_cache(cfg, n=8):
    cache = tiny_cache(cfg, num_blocks=n, block_size=BS)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(3)))
    return cache


def test_store_moves_blocks_through_host_and_disk_bit_exact(tmp_path):
    cfg = tiny_config()
    cache = filled_cache(cfg)
    store = TierStore(cache, 2, 3, str(tmp_path))
    assert store.host_bytes == 2 * cache.layout.bytes_per_block
    want = cache.data[:, :, [5, 6]].clone()
    store.apply(TierPlan(to_host=[(5, 0), (6, 1)]))
    store.apply(TierPlan(to_disk=[(0, 2), (1, 0)]))
    for f in (0, 2):
        assert (tmp_path / f"{f:012d}.kvc").stat().st_size <= cache.layout.bytes_per_block + DISK_SLOT_OVERHEAD
    store.host.data.zero_()
    assert store.apply(TierPlan(from_disk=[(2, 1), (0, 0)])) == []
    cache.data[:, :, [1, 2]] = 0
    store.apply(TierPlan(to_device=[(1, 1), (0, 2)]))
    assert torch.equal(cache.data[:, :, 1], want[:, :, 0]) and torch.equal(cache.data[:, :, 2], want[:, :, 1])


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_store_rejects_a_corrupted_or_truncated_disk_block(tmp_path, damage):
    cfg = tiny_config()
    cache = filled_cache(cfg)
    store = TierStore(cache, 2, 2, str(tmp_path))
    store.apply(TierPlan(to_host=[(3, 0), (4, 1)]))
    store.apply(TierPlan(to_disk=[(0, 0), (1, 1)]))
    path = tmp_path / f"{0:012d}.kvc"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[:-16]))
    else:
        path.unlink()
    before = store.host.data[:, :, 0].clone()
    assert store.apply(TierPlan(from_disk=[(0, 0), (1, 1)])) == [0]  # only the damaged one
    assert torch.equal(store.host.data[:, :, 0], before)  # nothing of it was written


# ---------------------------------------------------------------------------------- engine: same tokens
@pytest.fixture(scope="module")
def reference():
    return engine_waves(on=False)[0]


@pytest.mark.parametrize("host, disk", [(0, 0), (16, 0), (3, 0), (3, 16)], ids=["device", "host", "small-host", "host+disk"])
def test_engine_same_tokens_with_tiers(reference, tmp_path, host, disk):
    outs, eng = engine_waves(True, host, disk, str(tmp_path))
    assert outs == reference
    stats = eng.kv_manager.tier_stats()
    if host == 16:
        assert stats["host"].hits >= 4 * TBS  # SYS's blocks came back from host memory
    if disk:
        assert stats["disk"].hits >= 3 * TBS  # ... or from disk, through host memory (3 slots: 3 blocks at a time)
        assert eng.runner.tiers.moved["from_disk"][0] > 0


def test_engine_recomputes_a_corrupted_disk_block(reference, tmp_path):
    def corrupt_all(eng):
        for p in tmp_path.glob("*.kvc"):
            raw = bytearray(p.read_bytes())
            raw[-3] ^= 0xFF
            p.write_bytes(bytes(raw))

    outs, eng = engine_waves(True, 3, 16, str(tmp_path), damage=corrupt_all)
    assert outs == reference  # the rejected blocks were recomputed, never used
    assert eng.kv_manager.disk.rejected > 0 and eng.kv_manager.tier_stats()["disk"].hits == 0


# ---------------------------------------------------------------------------------- pipelines: same tokens
@pytest.mark.parametrize("kw, host", [(dict(mode="colocated", depth=2), 3), (dict(mode="disaggregated", prompt_depth=1, token_depth=1), 6)],
                         ids=["colocated-2", "disagg-1-1"])
def test_pipelines_same_tokens_with_host_and_disk_tiers(reference, tiny_ckpt_dir, tmp_path, kw, host):
    """(A prompt pipeline releases a whole batch's blocks at once, so its evictions come in bursts: a
    host tier of 3 blocks would keep only 3 of them; it gets 6.)"""
    import asyncio

    from kvflow.config import ClusterConfig
    from kvflow.controller.controller import Controller

    bpb = KVLayout.for_model(tiny_config(), 1, TBS).bytes_per_block
    depth = kw.get("depth", 1)
    eng = EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=24, block_size=TBS, host_kv_bytes=host * bpb,
                       disk_kv_bytes=16 * (bpb + DISK_SLOT_OVERHEAD * depth), disk_kv_path=str(tmp_path))
    cfg = ClusterConfig(engine=eng, microbatch_size=4, prompt_microbatch_size=4, heartbeat_timeout_s=30.0, **kw)

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        outs, i = [], 0
        try:
            for wave in WAVES:
                async def one(p, j):
                    toks = []
                    async for o in ctrl.generate(p, wave_params(j), f"r{j}"):
                        toks += o.new_token_ids
                    return toks
                outs += await asyncio.gather(*[one(p, i + k) for k, p in enumerate(wave)])
                i += len(wave)
            return outs, ctrl.stats(), [p.kv_manager for p in ctrl.pipelines]
        finally:
            await ctrl.shutdown()

    outs, stats, pools = asyncio.run(main())
    assert outs == reference
    first = pools[0]  # the colocated or the prompt pipeline: the one with lower tiers
    first.pool.check(), first.host.check(), first.disk.check()
    name = cfg.pipelines()[0].name
    assert stats.prefix_cache[(name, "host")].hits + stats.prefix_cache[(name, "disk")].hits >= 3 * TBS
    if kw["mode"] == "colocated":
        assert stats.prefix_cache[(name, "disk")].hits >= 3 * TBS
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cfg.stage_names()[:depth])  # one store per stage


def test_metrics_report_hits_and_hit_rate_per_tier(tmp_path):
    from kvflow.api.metrics import APIMetrics

    _, eng = engine_waves(True, 3, 16, str(tmp_path))
    stats = eng.kv_manager.tier_stats()
    from kvflow.serving.backend import BackendStats

    from prometheus_client.parser import text_string_to_metric_families

    text = APIMetrics().render(BackendStats(prefix_cache={("engine", t): c for t, c in stats.items()}), True).decode()
    samples = {(s.name, s.labels.get("pool"), s.labels.get("tier")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    for tier in ("device", "host", "disk"):
        c = stats[tier]
        assert samples["kvflow_prefix_cache_hits_total", "engine", tier] == c.hits
        assert samples["kvflow_prefix_cache_hit_rate", "engine", tier] == pytest.approx(c.hit_rate)
    assert stats["disk"].hits > 0 and stats["device"].queries == stats["disk"].queries

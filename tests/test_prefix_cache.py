"""Prefix caching: the scheduler's use of cached blocks (exact block ids), and the same tokens with it on
and off in every mode (engine, colocated depth 2, disaggregated 1+1), greedy and seeded requests mixed,
including with a worker killed while requests share cached blocks."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.controller import Controller
from kvflow.kv.manager import KVCacheManager
from kvflow.sched.request import Request
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import Scheduler, SchedulerConfig

from conftest import on_loop_thread, run_to_completion, tiny_engine


def req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def run(s: Scheduler, tok: int = 7) -> None:
    for _ in range(1000):
        if not s.has_unfinished:
            return
        out = s.schedule()
        assert not out.is_empty
        s.update(out, {x.request.request_id: tok for x in out.seqs if x.completes_prompt})
    raise AssertionError("the scheduler did not finish")


SYS = list(range(10, 30))  # 20 tokens: 5 blocks of 4


def test_a_shared_prefix_is_counted_as_computed_and_its_blocks_are_shared():
    kv = KVCacheManager(32, 4)
    s = Scheduler(SchedulerConfig(), kv, 256)
    a = req("a", SYS + [40, 41, 42], max_tokens=2)
    s.add(a)
    out = s.schedule()
    assert (out.seqs[0].start, out.seqs[0].num_new_tokens) == (0, 23)
    s.update(out, {"a": 7})  # a keeps running: its 5 full prompt blocks are cached and shared from now on
    b = req("b", SYS + [50])
    s.add(b)
    out = s.schedule()
    got = {x.request.request_id: (x.start, x.num_new_tokens, x.new_block_ids) for x in out.seqs}
    assert got["b"] == (20, 1, tuple(b.block_ids)) and b.block_ids[:5] == a.block_ids[:5]
    assert b.block_ids[5] not in a.block_ids and [kv.pool.ref[x] for x in a.block_ids[:6]] == [2] * 5 + [1]
    assert (kv.stats.queries, kv.stats.hits) == (23 + 21, 20)
    s.update(out, {"a": 7, "b": 7})
    run(s)
    assert kv.num_free_blocks == 32 and kv.pool.num_cached >= 5


@pytest.mark.parametrize("prompt, hit", [(SYS + [1, 2, 3, 4], 20), (SYS + [1, 2, 3], 20), (SYS, 16)])
def test_a_whole_prompt_hit_still_computes_its_last_token(prompt, hit):
    kv = KVCacheManager(32, 4)
    s = Scheduler(SchedulerConfig(), kv, 256)
    s.add(req("a", prompt))
    run(s)
    b = req("b", prompt)
    s.add(b)
    out = s.schedule()
    # whole blocks only, and never the last token (it gives the logits of the first one): an aligned
    # prompt recomputes its whole last block, in a new block of its own
    assert (out.seqs[0].start, out.seqs[0].num_new_tokens) == (hit, len(prompt) - hit)
    assert out.seqs[0].completes_prompt
    assert all(kv.pool.ref[x] == 1 for x in b.block_ids)


def test_lru_eviction_takes_the_end_of_the_stalest_prefix_first():
    kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(), kv, 256)
    a = req("a", list(range(10, 22)), max_tokens=1)  # 3 blocks
    s.add(a)
    run(s)
    blocks_a = list(kv.pool.lookup(a.block_hashes))
    assert len(blocks_a) == 3 and kv.pool.num_cached == 3
    c = req("c", list(range(50, 71)), max_tokens=1)  # 6 blocks: the 5 free ones, then a's last block
    s.add(c)
    out = s.schedule()
    assert c.block_ids[-1] == blocks_a[2] and kv.stats.evictions == 1
    s.update(out, {"c": 7})
    d = req("d", list(range(10, 22)) + [5])  # a's prefix: its first two blocks survived
    s.add(d)
    out = s.schedule()
    assert out.seqs[0].start == 8 and d.block_ids[:2] == blocks_a[:2]


def test_preempting_one_of_two_sharers_keeps_the_blocks_for_the_other():
    kv = KVCacheManager(10, 4)
    s = Scheduler(SchedulerConfig(reserve_kv=False), kv, 256)
    a = req("a", SYS, max_tokens=30)
    s.add(a)
    out = s.schedule()
    s.update(out, {"a": 7})
    b = req("b", SYS + [60], max_tokens=30)
    s.add(b)
    shared = list(a.block_ids[:5])  # SYS: 5 full blocks, b's hit
    while not any(x is b for x in out.preempted):
        out = s.schedule()
        s.update(out, {x.request.request_id: 7 for x in out.seqs if x.completes_prompt})
        kv.pool.check()
    assert not b.block_ids and a.block_ids[:5] == shared and all(kv.pool.ref[x] == 1 for x in shared)


def test_token_role_registers_the_blocks_its_kv_arrived_in_and_off_means_no_hits():
    kv = KVCacheManager(16, 4)
    s = Scheduler(SchedulerConfig(), kv, 256, role="token")
    a = req("a", SYS + [1])
    a.append_token(5, 256)
    kv.ensure(a.block_ids, a.num_tokens - 1)
    s.add_running(a)
    assert kv.match(SYS + [1, 5, 9], [], 23).num_tokens == 20  # 21 tokens arrived: 5 full blocks
    off = KVCacheManager(16, 4, prefix_caching=False)
    s2 = Scheduler(SchedulerConfig(), off, 256)
    for rid in "ab":
        s2.add(req(rid, SYS + [1]))
        out = s2.schedule()
        assert out.seqs[0].start == 0
        s2.update(out, {rid: 7})
        run(s2)
    assert off.stats.hits == 0 and off.pool.num_cached == 0


# ---------------------------------------------------------------------------------- every mode
BS = 4
OTHER = list(range(60, 84))  # 24 tokens, no block in common with SYS
PHASES = [
    # 1: two prompts computed from scratch (SYS's 5 blocks get cached; the aligned one 6)
    [SYS + [40, 41, 42], SYS + [70, 71, 72, 73]],
    # 2: a shared system prompt; a whole-prompt hit of an aligned prompt; a repeat of a non-aligned one
    [SYS + [50, 51], SYS + [70, 71, 72, 73], SYS + [40, 41, 42]],
    # 3: fillers that need most of the pool: cached blocks are evicted, LRU first
    [OTHER, [o + 1 for o in OTHER], [o + 2 for o in OTHER]],
    # 4: after the evictions: SYS again (what is left of it, or recomputed) twice
    [SYS + [55], SYS + [56, 57]],
]
LENGTHS = [6, 5, 4, 6, 5]


def params(i: int) -> SamplingParams:
    """Greedy, and every third request seeded sampling."""
    n = LENGTHS[i % len(LENGTHS)]
    if i % 3 == 1:
        return SamplingParams(max_tokens=n, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def engine_phases(prefix_caching: bool, num_kv_blocks: int, phases=PHASES, params_of=params):
    """Each phase's requests run to completion in one engine before the next phase is added."""
    eng = tiny_engine(num_kv_blocks=num_kv_blocks, block_size=BS, prefix_caching=prefix_caching)
    outs, i = [], 0
    for phase in phases:
        reqs = []
        for p in phase:
            reqs.append(eng.add_request(p, params_of(i)))
            i += 1
        final = run_to_completion(eng)
        outs += [final[r.request_id].token_ids for r in reqs]
    return outs, eng.kv_manager.stats


def test_engine_same_tokens_with_prefix_caching_on_and_off():
    off, off_stats = engine_phases(False, 24)
    on, stats = engine_phases(True, 24)
    assert on == off
    assert off_stats.hits == 0
    assert stats.hits >= 5 * BS + 5 * BS + 5 * BS and stats.evictions > 0  # phase 2 alone hits 3 x 5 blocks


def serve_phases(cfg: ClusterConfig):
    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        outs, i = [], 0
        try:
            for phase in PHASES:
                tasks = []
                for p in phase:
                    tasks.append(_collect(ctrl, p, params(i), f"r{i}"))
                    i += 1
                outs += await asyncio.gather(*tasks)
            return outs, ctrl.stats(), [p.kv_manager.num_free_blocks for p in ctrl.pipelines]
        finally:
            await ctrl.shutdown()

    return asyncio.run(main())


async def _collect(ctrl, prompt, p, rid):
    toks = []
    async for out in ctrl.generate(prompt, p, rid):
        toks += out.new_token_ids
    return toks


@pytest.mark.parametrize("kw", [dict(mode="colocated", depth=2), dict(mode="disaggregated", prompt_depth=1, token_depth=1)],
                         ids=["colocated-2", "disagg-1-1"])
def test_pipelines_same_tokens_with_prefix_caching_on_and_off(tiny_ckpt_dir, kw):
    def cfg(on: bool) -> ClusterConfig:
        eng = EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=24, block_size=BS, enable_prefix_caching=on)
        return ClusterConfig(engine=eng, microbatch_size=4, prompt_microbatch_size=4, heartbeat_timeout_s=30.0, **kw)

    engine_off, _ = engine_phases(False, 24)
    on, stats, free = serve_phases(cfg(True))
    off, off_stats, _ = serve_phases(cfg(False))
    assert on == off == engine_off
    assert free == [24] * len(free), "KV blocks leaked"
    pools = {pool: c for (pool, tier), c in stats.prefix_cache.items() if tier == "device"}
    assert all(c.hits == 0 for c in off_stats.prefix_cache.values())
    if kw["mode"] == "colocated":
        assert pools["colocated"].hits >= 15 * BS and pools["colocated"].evictions > 0
    else:  # prompt side: fewer tokens prefilled; token side: fewer blocks streamed (only the missing ones)
        # (a token worker's receiver expects exactly [hit, total) of each request and rejects anything else)
        assert pools["prompt"].hits >= 15 * BS and pools["token"].hits >= 15 * BS


@pytest.mark.parametrize("kw, victim", [
    (dict(mode="colocated", depth=2, replication="none"), "colocated-1"),
    (dict(mode="colocated", depth=2), "colocated-1"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0"),
], ids=["colocated-2:recompute", "colocated-2:replica", "disagg-1-1:token"])
def test_a_killed_worker_with_shared_cached_blocks_changes_no_token(tiny_ckpt_dir, kw, victim):
    """Phase 1 caches SYS; phase 2's requests share it (blocks referenced by several requests) when a
    worker is SIGKILLed mid-generation: the pipeline forgets its cached prefixes, requests are
    recomputed or resumed, and every token is the engine's without prefix caching."""
    import os
    import signal

    phases = [[SYS + [40, 41, 42]], [SYS + [50 + i] for i in range(4)]]
    lengths = [4, 30, 30, 30, 30]

    def p(i):
        return SamplingParams(max_tokens=lengths[i], temperature=0.8 if i == 2 else 0, seed=7, ignore_eos=True)

    expected, _ = engine_phases(False, 64, phases, p)

    cfg = ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=64, block_size=BS), microbatch_size=4,
                        prompt_microbatch_size=4, heartbeat_timeout_s=30.0, **kw)

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            outs = await asyncio.gather(_collect(ctrl, phases[0][0], p(0), "r0"))
            # The kill happens on the controller's loop thread, in the result handler that brings
            # phase 2's 24th token: the requests are mid-generation then however loaded the machine
            # is (an event loop woken after the 24th token could find them all finished).
            base, seen = ctrl.generated, {}

            def kill() -> None:
                seen["shared"] = sum(1 for p_ in ctrl.pipelines for r in p_.kv_manager.pool.ref if r > 1)
                os.kill(ctrl.stages[victim].process.pid, signal.SIGKILL)

            on_loop_thread(ctrl, (lambda: ctrl.generated - base >= 24, kill))

            async def one(j):
                toks = []
                async for out in ctrl.generate(phases[1][j - 1], p(j), f"r{j}"):
                    toks += out.new_token_ids
                return toks

            tasks = [asyncio.ensure_future(one(j)) for j in range(1, 5)]
            outs += await asyncio.wait_for(asyncio.gather(*tasks), 300)
            shared = seen.get("shared", 0)
            deadline = asyncio.get_running_loop().time() + 120
            while ctrl.recovery.recoveries < 1:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            return outs, shared, ctrl.stats(), [p_.kv_manager.num_free_blocks for p_ in ctrl.pipelines]
        finally:
            await ctrl.shutdown()

    outs, shared, stats, free = asyncio.run(main())
    assert outs == expected
    assert shared > 0, "the SYS blocks were meant to be shared when the worker died"
    assert stats.recoveries_total == 1 and free == [64] * len(free)

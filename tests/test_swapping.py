"""Microbatch swapping (DéjàVu §4.2.2): the scheduler's device regions, the worker-side swapper's
ordering, and the same tokens (greedy and seeded) with swapping on and off in a colocated pipeline."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.controller import Controller
from kvflow.kv.manager import KVCacheManager
from kvflow.sched.request import Request
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.admission import Limits, validate
from kvflow.sched.scheduler import Scheduler, SchedulerConfig
from kvflow.streaming.swapper import SwapSeq, Swapper

from conftest import run_to_completion, tiny_cache, tiny_config, tiny_engine

PROMPTS = [[5, 6, 7], list(range(10, 31)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 66)), [11, 12]]
LENGTHS = [9, 3, 7, 1, 6, 8]


def params(i: int) -> SamplingParams:
    if i % 3 == 1:
        return SamplingParams(max_tokens=LENGTHS[i], temperature=0.9, top_k=20, seed=7 + i, ignore_eos=True)
    return SamplingParams(max_tokens=LENGTHS[i], temperature=0, ignore_eos=True)


def test_batches_alternate_regions_and_a_microbatch_fits_its_region():
    cfg = SchedulerConfig(policy="microbatch", microbatch_size=2, max_in_flight=4, swap_regions=2, swap_region_blocks=6)
    s = Scheduler(cfg, KVCacheManager(24, 4), 256)
    for i in range(6):
        s.add(Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    outs = [s.schedule() for _ in range(4)]
    # 3 blocks per request (8 + 4 tokens): two fit a region of 6 blocks
    assert [o.swap_region for o in outs[:3]] == [0, 1, 0] and outs[3].is_empty  # 6 requests: 3 microbatches
    assert [x.device_block_ids for x in outs[0].seqs] == [(0, 1, 2), (3, 4, 5)]
    assert [x.device_block_ids for x in outs[1].seqs] == [(6, 7, 8), (9, 10, 11)]
    with pytest.raises(ValueError, match="device region"):
        validate(Request("big", list(range(1, 30)), SamplingParams(max_tokens=4)), Limits(256, None, 6), [s.kv_manager])
    with pytest.raises(ValueError, match="bad swap regions"):
        SchedulerConfig(swap_regions=2, swap_region_blocks=0)


def test_swapper_swaps_in_the_computed_kv_and_writes_back_only_the_new_tokens():
    cfg = tiny_config()
    host = tiny_cache(cfg, num_blocks=12, block_size=4)
    host.data.copy_(torch.randn(host.data.shape, generator=torch.Generator().manual_seed(1)))
    device = tiny_cache(cfg, num_blocks=4, block_size=4)
    sw = Swapper(host, device, 2)
    try:
        seq = SwapSeq("a", (7, 3), (2, 3), 5, 6)  # 5 tokens computed (blocks 7, 3), the 6th computed now
        sw.prefetch("s0", 1, [seq])
        sw.wait("s0")
        assert torch.equal(device.data[:, :, 2], host.data[:, :, 7]) and torch.equal(device.data[:, :, 3], host.data[:, :, 3])
        device.data[:, :, 3] = 9.0  # the step writes token 5 (block 3, offset 1) ... and nothing else may go back
        before = host.data[:, :, 3].clone()
        sw.write_back([seq])
        assert torch.equal(host.data[:, :, 3, 1], device.data[:, :, 3, 1])
        assert torch.equal(host.data[:, :, 3, 0], before[:, :, 0]) and torch.equal(host.data[:, :, 3, 2:], before[:, :, 2:])
        # the next step in region 1 waits for this one to be done (its KV written back)
        sw.prefetch("s1", 0, [SwapSeq("b", (0,), (0,), 4, 5)])
        sw.prefetch("s2", 1, [SwapSeq("c", (1,), (2,), 4, 5)])
        sw.wait("s1")
        started = threading.Event()
        t = threading.Thread(target=lambda: (started.set(), sw.wait("s2")))
        t.start()
        started.wait()
        t.join(0.2)
        assert t.is_alive(), "s2 was swapped into region 1 before s0 was done with it"
        sw.done("s0")
        t.join(5.0)
        assert not t.is_alive() and torch.equal(device.data[:, :, 2], host.data[:, :, 1])
    finally:
        sw.close()


def serve(cfg: ClusterConfig):
    async def one(ctrl, i):
        toks = []
        async for out in ctrl.generate(PROMPTS[i], params(i), f"r{i}"):
            toks += out.new_token_ids
        return toks

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            outs = await asyncio.gather(*[one(ctrl, i) for i in range(len(PROMPTS))])
            return outs, [p.kv_manager.num_free_blocks for p in ctrl.pipelines], [p.kv_manager.num_blocks for p in ctrl.pipelines]
        finally:
            await ctrl.shutdown()

    return asyncio.run(main())


CASES = {
    # two regions of 8 blocks, pool 16 (no more than without swapping at depth 2: on and off compared)
    "colocated-2-microbatch": (dict(mode="colocated", depth=2, policy="microbatch"), 2, [16]),
    # three batches in flight, two regions of 8 blocks on each stage's device, pool 24 in host memory
    "colocated-3-continuous": (dict(mode="colocated", depth=3), 4, [24]),
    # the token pipeline swaps (one region of 16 at depth 1); its KV arrives from the prompt side into host memory
    "disagg-1-1-continuous": (dict(mode="disaggregated", prompt_depth=1, token_depth=1), 2, [16, 16]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_tokens_with_swapping_on_and_off(tiny_ckpt_dir, tiny4_ckpt_dir, case):
    kw, layers, pools = CASES[case]
    ckpt = tiny_ckpt_dir if layers == 2 else tiny4_ckpt_dir
    ref_eng = tiny_engine(tiny_config(num_layers=layers), num_kv_blocks=256, block_size=4)
    reqs = [ref_eng.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    final = run_to_completion(ref_eng)
    ref = [final[r.request_id].token_ids for r in reqs]

    def cfg(swapping: bool) -> ClusterConfig:
        return ClusterConfig(engine=EngineConfig(model=str(ckpt), num_kv_blocks=16, block_size=4), microbatch_size=2,
                             prompt_microbatch_size=2, heartbeat_timeout_s=30.0, swapping=swapping, **kw)

    on, free, blocks = serve(cfg(True))
    assert on == ref
    assert blocks == pools and free == blocks  # the swapped pool lives in host memory; nothing leaked
    if case == "colocated-2-microbatch":
        off, _, _ = serve(cfg(False))
        assert off == ref


def test_swapping_is_refused_where_it_is_not_implemented():
    with pytest.raises(ValueError, match="needs the continuous policy"):
        ClusterConfig(mode="disaggregated", policy="microbatch", swapping=True)
    p = ClusterConfig(mode="disaggregated", swapping=True, engine=EngineConfig(num_kv_blocks=10), token_depth=4).pipelines()
    cfg = ClusterConfig(mode="disaggregated", swapping=True, engine=EngineConfig(num_kv_blocks=10), token_depth=4)
    assert cfg.swap_layout(p[0]) == (0, 0, 10) and cfg.swap_layout(p[1]) == (2, 5, 20)  # prompt pipelines never swap


def test_continuous_batches_take_only_what_fits_a_region():
    cfg = SchedulerConfig(max_in_flight=2, swap_regions=2, swap_region_blocks=5, max_num_batched_tokens=64)
    s = Scheduler(cfg, KVCacheManager(20, 4), 256)
    for i in range(3):
        s.add(Request(f"r{i}", list(range(1, 10)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    a = s.schedule()  # 9-token prompts: 3 blocks each, one per region of 5
    b = s.schedule()
    assert [x.request.request_id for x in a.seqs] == ["r0"] and [x.request.request_id for x in b.seqs] == ["r1"]
    assert (a.swap_region, b.swap_region) == (0, 1) and b.seqs[0].device_block_ids == (5, 6, 7)

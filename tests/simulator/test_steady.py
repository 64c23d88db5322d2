"""The simulator's shortcuts at scale change no decision: a steady pipeline that runs ahead
(`kvflow.simulator.steady`) and pools that count blocks where no prefix can be hit give the batch
log, the per-request times and the busy times of simulating every pass as an event over named,
hashed blocks."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import ConstantPerf, PacedPerf

from kvflow.kv.block_pool import ANONYMOUS, BlockPool, OutOfBlocks
from kvflow.kv.manager import KVCacheManager
from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.sched.handoff import Handoff
from kvflow.simulator import Failure, LengthDist, Layout, PipelineGroup, SimConfig, Simulator, Workload, synthetic

OPT = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))

CASES = [  # (layout, perf, requests, prompt length, output lengths, arrival rate, length group)
    (Layout(PipelineGroup(2, 4), PipelineGroup(2, 4, 3)), OPT, 200, 300, LengthDist(max_len=200), None, 4),
    (Layout(PipelineGroup(2, 4, 2), PipelineGroup(3, 8, 2)), OPT, 300, 100, LengthDist(max_len=120), None, 1),
    (Layout(PipelineGroup(2, 8, 5)), OPT, 300, 500, LengthDist(max_len=150), None, 8),
    (Layout(PipelineGroup(3, 4, 2)), OPT, 200, 50, LengthDist("lognormal", median=20, p90=90, max_len=200), 20.0, 1),
    (Layout(PipelineGroup(1, 4, 3)), ConstantPerf(0.05, 0.01), 150, 40, LengthDist(max_len=60), None, 1),
    (Layout(PipelineGroup(2, 2), PipelineGroup(2, 2, 2)), PacedPerf(), 40, 20, LengthDist(max_len=40), 5.0, 1),
]


def _run(layout, perf, w: Workload, steady: bool, **kw) -> Simulator:
    sim = Simulator(SimConfig(layout, **kw), perf, w, log_batches=True, steady=steady)
    sim.result = sim.run()
    return sim


def _same(a: Simulator, b: Simulator) -> None:
    for p, q in zip(a.prompt + a.token, b.prompt + b.token):
        assert list(p.batch_log) == list(q.batch_log), (p.role, p.index)
        assert p.busy == q.busy
        assert p.stage_free == q.stage_free
    for x, y in ((a.result.first_token, b.result.first_token), (a.result.finish, b.result.finish)):
        np.testing.assert_array_equal(x, y)
    assert (a.result.completions == 1).all()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_running_ahead_changes_nothing(case):
    layout, perf, n, prompt, lengths, rate, group = CASES[case]
    w = synthetic(n, prompt, lengths, rate, seed=case, group=group)
    ahead, each = _run(layout, perf, w, True), _run(layout, perf, w, False)
    assert ahead.steady and not each.steady and ahead.passes_run_ahead > 0
    _same(ahead, each)


def test_counted_blocks_decide_as_hashed_ones():
    """Generated prompts (no prompt ids given) are counted, not hashed; the same prompts given as
    ids go through the prefix cache, and every batch is the same."""
    layout, perf, n, prompt, lengths, rate, group = CASES[0]
    w = synthetic(n, prompt, lengths, rate, seed=3, group=group)
    named = Workload(w.arrival, w.prompt_len, w.output_len, tuple((i,) * prompt for i in range(n)))
    counted, hashed = _run(layout, perf, w, True), _run(layout, perf, named, False)
    assert not counted.caching and hashed.caching
    assert all(p.kv_manager.pool.anonymous for p in counted.prompt + counted.token)
    _same(counted, hashed)


def test_no_shortcut_where_a_prefix_may_hit_or_a_failure_replays():
    w = synthetic(20, 40, LengthDist(max_len=30), None, seed=0)
    lay = Layout(PipelineGroup(2, 4))
    assert Simulator(SimConfig(lay, policy="continuous"), OPT, w).caching  # a preempted request hits its own blocks
    assert not Simulator(SimConfig(lay, policy="continuous"), OPT, w).steady
    failing = Simulator(SimConfig(lay, failures=(Failure(1.0, "prompt", 0, 0),)), OPT, w)
    assert failing.caching and not failing.steady


def test_anonymous_pool_counts():
    pool = BlockPool(10, anonymous=True)
    a = pool.allocate(4)
    assert a == [ANONYMOUS] * 4 and pool.num_free == 6
    with pytest.raises(OutOfBlocks):
        pool.allocate(7)
    assert pool.num_free == 6  # all or nothing
    pool.free(reversed(a))
    assert pool.num_free == 10
    with pytest.raises(ValueError):
        pool.free([ANONYMOUS])  # none allocated
    with pytest.raises(ValueError):
        pool.take([ANONYMOUS])
    kv = KVCacheManager(10, 4, prefix_caching=False, block_ids=False)
    table: list[int] = []
    assert kv.ensure(table, 9) and len(table) == 3 and kv.num_free_blocks == 7
    assert kv.ensure(table, 12) and len(table) == 3
    assert not kv.ensure(table, 41) and len(table) == 3  # 11 blocks > 10: nothing changes
    kv.release(table)
    assert table == [] and kv.num_free_blocks == 10
    with pytest.raises(ValueError):
        KVCacheManager(10, 4, prefix_caching=True, block_ids=False)


@pytest.mark.parametrize("policy, blocks, failure", [("microbatch", 300, None), ("continuous", 120, None),
                                                     ("microbatch", 300, 30.0)])
def test_the_freest_token_pool_is_the_scans(policy, blocks, failure, monkeypatch):
    """The hand-off sends a token microbatch's worth of admissions to the token pool with the most
    free blocks (the first on a tie): its heap of counts picks the pool a scan of every pool picks,
    through finishes, token-side preemptions (continuous) and a recovery."""
    picks = []
    heap = Handoff._freest

    def checked(self):
        free = [t.kv_manager.num_free_blocks for t in self.token]
        tp = heap(self)
        assert tp is self.token[free.index(max(free))], free
        picks.append(self.token.index(tp))
        return tp

    monkeypatch.setattr(Handoff, "_freest", checked)
    w = synthetic(300, 200, LengthDist(max_len=150), 2.0, seed=5)
    fail = (Failure(failure, "token", 1, 1),) if failure else ()
    sim = Simulator(SimConfig(Layout(PipelineGroup(1, 4, 2), PipelineGroup(2, 4, 5)), policy=policy, kv_blocks=blocks,
                              failures=fail), OPT, w)
    res = sim.run()
    assert (res.completions >= 1).all()
    assert len(picks) > 50 and len(set(picks)) == 5
    if policy == "continuous":
        assert sim.executor.preemptions > 0

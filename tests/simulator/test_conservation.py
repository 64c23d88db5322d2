"""Every request completes exactly once, with and without failures, in every layout; runs are
deterministic under a seed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import ConstantPerf, workload

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.simulator import Failure, LengthDist, Layout, PipelineGroup, Recovery, SimConfig, Simulator, simulate, synthetic

LAYOUTS = [
    Layout(PipelineGroup(3, 4)),
    Layout(PipelineGroup(2, 4, 3)),
    Layout(PipelineGroup(2, 4), PipelineGroup(3, 8)),
    Layout(PipelineGroup(1, 2, 2), PipelineGroup(2, 4, 2)),
]


def _check(res, n):
    assert np.all(res.completions == 1)
    assert np.all(res.first_token >= res.arrival - 1e-12)
    assert np.all(res.finish >= res.first_token - 1e-12)
    assert len(res.finish) == n


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 3), st.integers(0, 10_000), st.sampled_from(["resume", "restart"]),
       st.sampled_from([None, 0.5, 5.0]), st.lists(st.floats(0.0, 30.0), max_size=3))
def test_conservation_with_failures(layout_i, seed, mode, rate, fail_times):
    lay = LAYOUTS[layout_i]
    w = synthetic(60, 50, LengthDist("lognormal", median=8, p90=30, max_len=64), rate, seed)
    role = "token" if lay.disaggregated else "prompt"
    group = lay.token if lay.disaggregated else lay.prompt
    failures = tuple(Failure(ft, role, i % group.count, i % group.depth) for i, ft in enumerate(fail_times))
    cfg = SimConfig(lay, failures=failures, recovery=Recovery(mode, 0.2, 1.0), swapping=bool(seed % 2))
    sim = Simulator(cfg, ConstantPerf(0.5, 0.05), w, log_batches=True)
    res = sim.run()
    _check(res, 60)
    # Every prompt pass (more than one new token: prompts are 50 tokens, decodes 1) is a request's
    # first prefill, the recompute of one that lost its KV to a failure, or a prompt chunk that was
    # in flight on a pipeline that kept its KV (redone), and nothing else.
    prefills = Counter(rid for p in sim.prompt + sim.token for batch in p.batch_log for rid, n in batch if n > 1)
    assert sorted(prefills) == sorted(str(i) for i in range(60))
    assert sum(prefills.values()) - 60 == res.restarts + sim.redone_prefills
    if mode == "resume" and not lay.disaggregated:
        assert res.restarts == 0  # the replacement restores the KV: nothing is recomputed


def test_prompt_pipeline_failure_in_disaggregated_layout_conserves():
    w = synthetic(200, 100, LengthDist("lognormal", median=20, p90=60, max_len=100), 2.0, 1)
    cfg = SimConfig(Layout(PipelineGroup(2, 4), PipelineGroup(2, 4)), failures=(Failure(5.0, "prompt", 0, 1),))
    res = simulate(cfg, ConstantPerf(0.5, 0.05), w)
    _check(res, 200)
    assert res.restarts > 0


def test_round_robin_dispatch_conserves():
    w = synthetic(101, 100, LengthDist(), None, 2, group=4)
    res = simulate(SimConfig(Layout(PipelineGroup(2, 4, 3)), dispatch="round_robin"), ConstantPerf(1.0, 0.01), w)
    _check(res, 101)


def test_resume_beats_restart():
    w = synthetic(64, 100, LengthDist("constant", value=200, max_len=200), None, 0)
    perf = ConstantPerf(1.0, 0.05)
    spans = {}
    for mode in ("resume", "restart"):
        cfg = SimConfig(Layout(PipelineGroup(4, 4)), failures=(Failure(30.0, "prompt", 0, 2),),
                        recovery=Recovery(mode, 1.0, 5.0))
        spans[mode] = simulate(cfg, perf, w).makespan
    assert spans["resume"] < spans["restart"]


def test_deterministic_under_seed():
    perf = AnalyticPerfModel(model_shape("opt-30b"), machine("4xV100-16GB"))
    lay = Layout(PipelineGroup(2, 8), PipelineGroup(3, 8))
    runs = [simulate(SimConfig(lay), perf, synthetic(300, 1000, LengthDist(), 1.0, seed)) for seed in (5, 5, 6)]
    np.testing.assert_array_equal(runs[0].finish, runs[1].finish)
    np.testing.assert_array_equal(runs[0].first_token, runs[1].first_token)
    assert not np.array_equal(runs[0].finish, runs[2].finish)


def test_utilization_and_cost_accounting():
    res = simulate(SimConfig(Layout(PipelineGroup(2, 1))), ConstantPerf(1.0, 0.1), workload([0.0, 0.0], [3, 3]))
    # Two microbatches, each one prompt (1.0) + two tokens (0.1) on every stage.
    assert res.machine_busy.tolist() == pytest.approx([2.4, 2.4])
    s = res.summary()
    assert s.machines == 2
    assert s.machine_hours == pytest.approx(2 * res.makespan / 3600)
    assert s.utilization_mean == pytest.approx(2.4 / res.makespan)

"""The simulator against closed forms: M/D/1 (DistServe eq. 1), the colocated pipeline's inverse
throughput (DéjàVu eq. 4), exact timelines of streaming and failure recovery."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import ConstantPerf, workload

from kvflow.planner.formulas import colocated_inverse_throughput
from kvflow.simulator import Failure, Layout, PipelineGroup, Recovery, SimConfig, simulate


def test_md1_matches_lindley_exactly_and_distserve_eq1_on_average():
    service, rate, n = 0.5, 1.0, 100_000  # utilisation R*D = 0.5
    rng = np.random.default_rng(7)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    res = simulate(SimConfig(Layout(PipelineGroup(1, 1))), ConstantPerf(service, 0.01), workload(arrival, np.ones(n)))
    # Lindley's recursion on the same sample path: W_{k+1} = max(0, W_k + D - (A_{k+1} - A_k)).
    wait = np.zeros(n)
    for k in range(1, n):
        wait[k] = max(0.0, wait[k - 1] + service - (arrival[k] - arrival[k - 1]))
    np.testing.assert_allclose(res.ttft, wait + service, rtol=0, atol=1e-9)
    eq1 = service + rate * service**2 / (2 * (1 - rate * service))
    assert abs(res.ttft.mean() - eq1) / eq1 < 0.02


@pytest.mark.parametrize("depth,y,t,n", [(1, 2.0, 0.25, 5), (3, 2.0, 0.25, 5), (4, 1.5, 0.1, 17), (8, 3.0, 0.02, 40)])
def test_rigid_colocated_pipeline_matches_dejavu_eq4(depth, y, t, n):
    rounds = 5
    w = workload(np.zeros(rounds * depth), np.full(rounds * depth, n))
    res = simulate(SimConfig(Layout(PipelineGroup(depth, 1)), rigid_rounds=True), ConstantPerf(y, t), w)
    per_microbatch = res.makespan / (rounds * depth)
    # Eq. 4's S3 = (N-1) D t + t counts one token step more than the timeline has: the last
    # microbatch's final token leaves stage D exactly (2D-1) Y + (N-1) D t after the round starts.
    assert per_microbatch == pytest.approx(colocated_inverse_throughput(depth, y, t, n) - t / depth, abs=1e-9)
    assert res.machine_busy == pytest.approx(np.full(depth, rounds * depth * (y + (n - 1) * t)))


@pytest.mark.parametrize("y,flexible_wins", [(0.1, True), (1.0, False)])
def test_microbatch_level_vs_rigid_rounds_with_early_stops(y, flexible_wins):
    """With early stops, refilling a slot at once avoids waiting for a round's longest microbatch,
    but each lone prompt then stalls the whole ring for ~D*Y; batching D prompts per round costs
    only (2D-1)*Y. At Y/t = 5 the refill wins; at Y/t = 50 the rigid rounds do."""
    rng = np.random.default_rng(3)
    w = workload(np.zeros(64), rng.integers(2, 200, 64))
    perf = ConstantPerf(y, 0.02)
    flexible = simulate(SimConfig(Layout(PipelineGroup(4, 1))), perf, w)
    rigid = simulate(SimConfig(Layout(PipelineGroup(4, 1)), rigid_rounds=True), perf, w)
    assert (flexible.makespan < rigid.makespan) == flexible_wins


def test_disaggregated_streaming_extra_time_is_transfer_minus_prompt():
    perf = ConstantPerf(1.0, 0.1, link_gbps=0.01)
    prompt = 1000
    transfer = prompt * perf.kv_bytes_per_token / perf.machine.link_bandwidth
    assert transfer > 1.0
    res = simulate(SimConfig(Layout(PipelineGroup(1, 1), PipelineGroup(1, 1))), perf,
                   workload([0.0], [11], prompt=prompt))
    assert res.ttft[0] == pytest.approx(1.0)
    assert res.finish[0] == pytest.approx(transfer + 10 * 0.1)  # KV ready at max(1, transfer)


@pytest.mark.parametrize("mode", ["resume", "restart"])
def test_failure_timeline(mode):
    perf = ConstantPerf(1.0, 0.1)
    rec = Recovery(mode=mode, detect_s=0.5, restart_s=2.0)
    cfg = SimConfig(Layout(PipelineGroup(1, 1)), failures=(Failure(1.55),), recovery=rec)
    res = simulate(cfg, perf, workload([0.0], [11]))
    # Tokens 2..6 finished at 1.1..1.5; the failure at 1.55 voids token 7's step.
    back = 1.55 + 0.5 + 2.0
    if mode == "resume":
        # The replacement restores the 15 tokens of KV in the cache (prompt 10 + tokens 1..5; token
        # 6's KV was being computed) from the replica; the voided step runs again, then 4 more.
        restore = 15 * perf.shape.kv_bytes_per_token / perf.machine.link_bandwidth
        assert res.finish[0] == pytest.approx(back + restore + 5 * 0.1)
        assert res.restarts == 0
    else:
        # Recompute (the controller's recovery): one prefill of prompt + the 6 tokens produced,
        # which samples token 7, then tokens 8..11.
        assert res.finish[0] == pytest.approx(back + 1.0 + 4 * 0.1)
        assert res.restarts == 1
    assert res.ttft[0] == pytest.approx(1.0)  # the first token the user saw keeps its time


def test_measured_recovery_costs_differ_by_mode():
    """Costs measured on a real run (`Recovery.measured`): resume pays its measured restore time
    instead of the modelled link transfer; restart never pays it, whatever it was measured at."""
    perf = ConstantPerf(1.0, 0.1)
    costs = {"detect_s": 0.25, "replace_s": 3.0, "restore_s": 0.75}
    back = 1.55 + 0.25 + 3.0
    finish = {}
    for mode in ("resume", "restart"):
        cfg = SimConfig(Layout(PipelineGroup(1, 1)), failures=(Failure(1.55),), recovery=Recovery.measured(mode, costs))
        finish[mode] = simulate(cfg, perf, workload([0.0], [11])).finish[0]
    assert finish["resume"] == pytest.approx(back + 0.75 + 5 * 0.1)
    assert finish["restart"] == pytest.approx(back + 1.0 + 4 * 0.1)
    with pytest.raises(ValueError):
        Recovery("resume", 0.0, 1.0, -1.0)


def test_pipeline_restart_costs_apart_from_replacing_one_worker():
    """Restart mode with `pipeline_restart_s` (every worker restarts, FasterTransformer) is down for
    that long; resume still only replaces the failed worker (`restart_s`)."""
    perf = ConstantPerf(1.0, 0.1)
    finish = {}
    for mode in ("resume", "restart"):
        rec = Recovery(mode, detect_s=0.5, restart_s=2.0, restore_s=0.0, pipeline_restart_s=7.0)
        cfg = SimConfig(Layout(PipelineGroup(1, 1)), failures=(Failure(1.55),), recovery=rec)
        finish[mode] = simulate(cfg, perf, workload([0.0], [11])).finish[0]
    assert finish["resume"] == pytest.approx(1.55 + 0.5 + 2.0 + 5 * 0.1)
    assert finish["restart"] == pytest.approx(1.55 + 0.5 + 7.0 + 1.0 + 4 * 0.1)
    # FasterTransformer restarts the request from scratch: its prompt again, then all 10 tokens.
    rec = Recovery("restart", detect_s=0.5, restart_s=2.0, pipeline_restart_s=7.0, from_scratch=True)
    res = simulate(SimConfig(Layout(PipelineGroup(1, 1)), failures=(Failure(1.55),), recovery=rec), perf,
                   workload([0.0], [11]))
    assert res.finish[0] == pytest.approx(1.55 + 0.5 + 7.0 + 1.0 + 10 * 0.1)
    assert res.ttft[0] == pytest.approx(1.0) and res.completions[0] == 1


def test_swap_in_uses_every_devices_host_link():
    """A stage's KV is split over its tensor-parallel devices, each swapping over its own PCIe link."""
    from kvflow.perf import AnalyticPerfModel, machine, model_shape

    two = AnalyticPerfModel(model_shape("opt-30b"), machine("2xV100-16GB"))
    nbytes = 8 * 1000 * two.shape.layers_per_stage(4) * two.shape.kv_bytes_per_token_layer
    assert two.swap_in_time(8, 1000, 4) == pytest.approx(nbytes / (2 * 12e9))
    assert two.with_tensor_parallel(1).swap_in_time(8, 1000, 4) == pytest.approx(2 * two.swap_in_time(8, 1000, 4))


class _Neighbourly(ConstantPerf):
    """Constant stage times, twice as slow beside a busy stage of the same host."""

    def co_run_factor(self, batch) -> float:
        return 2.0


def test_shared_host_slows_a_step_while_another_stage_computes():
    """Two one-stage pipelines on one host, two requests at t=0, one token each (the prompt pass,
    1 s alone). The first pass placed runs alone: 1 s. The second starts beside it: at half speed
    while the first computes (0.5 s of work in its 1 s), then the remaining 0.5 s alone: 1.5 s.
    Without `shared_host` both take 1 s; a factor of 1 changes nothing."""
    w = workload([0.0, 0.0], [1, 1])
    lay = Layout(PipelineGroup(1, 1, 2))
    res = simulate(SimConfig(lay, shared_host=True), _Neighbourly(1.0, 0.1), w)
    assert sorted(res.ttft) == pytest.approx([1.0, 1.5])
    assert sorted(simulate(SimConfig(lay), _Neighbourly(1.0, 0.1), w).ttft) == pytest.approx([1.0, 1.0])
    assert sorted(simulate(SimConfig(lay, shared_host=True), ConstantPerf(1.0, 0.1), w).ttft) == pytest.approx([1.0, 1.0])


def test_swapped_token_step_lasts_max_of_compute_and_swap_in_of_the_context_so_far():
    """DéjàVu Appendix G.1: with microbatch swapping a token step lasts max(t, transf_i), transf_i
    the swap-in of the microbatch's KV up to its current context i (not its reserved maximum) over
    the host link. TINY: 2 of 8 layers per stage at depth 4, 256 bytes of KV per token and layer, so
    512 bytes per token and stage; a host link of 51,200 B/s makes transf_i = i / 100 s, above
    t = 0.1 s from context 10 on."""
    from dataclasses import replace

    perf = ConstantPerf(1.0, 0.1)
    perf.machine = replace(perf.machine, host_bandwidth=512 * 100)
    assert perf.swap_in_time(1, 25, 4) == pytest.approx(0.25)
    prompt, out = 6, 12
    lay = Layout(PipelineGroup(4, 1))
    res = simulate(SimConfig(lay, swapping=True, prefix_caching=False), perf, workload([0.0], [out], prompt=prompt))
    # Prefill passes the 4 stages at y each (no swap); token k (k = 1..out-1) writes context prompt + k.
    steps = [max(0.1, (prompt + k) / 100) for k in range(1, out)]
    assert res.finish[0] == pytest.approx(4 * 1.0 + 4 * sum(steps))
    assert simulate(SimConfig(lay, prefix_caching=False), perf, workload([0.0], [out], prompt=prompt)).finish[0] == \
        pytest.approx(4 * 1.0 + 4 * 0.1 * (out - 1))

"""DistServe's Algorithm 1 (`kvflow.planner.placement`) and the rate search, on closed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.perf.perf_model import PerfModel
from kvflow.planner.formulas import Infeasible
from kvflow.planner.goodput import search_rate
from kvflow.planner.placement import GoodputSpace, PhaseConfig, PlacementSearch
from kvflow.simulator.workload import Workload
from kvflow.slo import SLO
from tests.simulator.sim_helpers import TINY

Y, T0, C = 0.1, 0.02, 0.001  # seconds: a whole prompt; a decode step's fixed and per-sequence parts


class SplitPerf(PerfModel):
    """A model split over `depth` stages with a 10% cost per extra stage; prefill costs Y per prompt
    (compute-bound: batching buys nothing), a decode step T0 + C per sequence; free hops; memory
    for 64k tokens of KV per pipeline."""

    def __init__(self) -> None:
        super().__init__(TINY, machine("1xA100-80GB", link_gbps=1e6))

    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        return batch * Y * (1 + 0.1 * (depth - 1)) / depth

    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        return (T0 + C * batch) * (1 + 0.1 * (depth - 1)) / depth

    def hop_time(self, batch: int, tokens: int) -> float:
        return 0.0

    def kv_capacity_tokens(self, depth: int, resident: int | None = None) -> int:
        return 64 * 1024  # ample for these workloads, and a small block pool to simulate


def even(n: int, out: int, prompt: int = 16):
    """Evenly spaced arrivals (a D/D/1 queue per instance: no queueing below capacity)."""
    return lambda rate: Workload(np.arange(n) / rate, np.full(n, prompt, dtype=np.int64), np.full(n, out, dtype=np.int64))


def test_search_rate_brackets_a_step_and_respects_the_cap():
    r = search_rate(lambda rate: 1.0 if rate <= 3.7 else 0.0, 0.9, hi=1.0, rel_tol=0.02)
    assert 3.7 * 0.98 <= r.rate <= 3.7 and r.attainment == 1.0
    r = search_rate(lambda rate: 1.0 if rate <= 3.7 else 0.0, 0.9, hi=50.0, rel_tol=0.02)
    assert 3.7 * 0.98 <= r.rate <= 3.7
    assert search_rate(lambda rate: 1.0, 0.9, hi=1.0, cap=2.5).rate == 2.5
    assert search_rate(lambda rate: 0.0, 0.9, hi=1.0, max_steps=5).rate == 0.0


def test_prefill_and_decode_chosen_separately_with_their_known_optimum():
    """Prefill: every depth carries 1/Y per device at best, extra stages cost 10%, so one stage
    wins with goodput 1/Y = 10 req/s (D/D/1: no queue below it, a growing one above). Decode: a
    request's token takes T0 + C b per pipeline cycle, so TPOT <= 30 ms allows b <= 10 and the
    largest batch offered under it, 8, carries the most per device. Replicas: ceil(R / goodput)."""
    slo = SLO(ttft=1.5 * Y, tpot=0.03)
    search = PlacementSearch(SplitPerf(), even(100, 20), slo, 0.9,
                             GoodputSpace(max_depth=3, microbatches=(1, 2, 4, 8, 16, 32), rel_tol=0.03))
    pl = search.place(rate=25.0, colocated=False)
    assert pl.prefill.config == PhaseConfig(1, 1, pl.prefill.config.microbatch)
    assert 1 / Y * 0.97 <= pl.prefill.rate <= 1 / Y * 1.001
    assert pl.decode.config.microbatch == 8 and pl.decode.config.depth == 1
    assert pl.decode.rate <= 8 / ((T0 + 8 * C) * 19) * 1.001  # its throughput bound
    assert pl.prefill_instances >= math.ceil(25.0 / pl.prefill.rate) == 3
    assert pl.decode_instances >= math.ceil(25.0 / pl.decode.rate)
    assert pl.attainment >= 0.9
    assert pl.devices == pl.prefill_instances + pl.decode_instances * pl.decode.config.depth


def test_tensor_parallel_degree_chosen_when_only_it_meets_the_ttft_slo():
    """OPT-13B on 2xA100 machines: one prompt of 512 takes ~84 ms on one GPU, ~44 ms on two
    (tensor parallel, with its all-reduces); a 70 ms TTFT SLO leaves only tp = 2 (depth 2 on one GPU
    each still takes ~84 ms end to end), depth 1 first (the same work on fewer devices)."""
    perf = AnalyticPerfModel(model_shape("opt-13b"), machine("2xA100-80GB"))
    assert perf.tensor_parallel_degrees == (1, 2)
    one = perf.with_tensor_parallel(1)
    assert one.machine.devices == 1 and one.machine.usable_memory == perf.machine.usable_memory / 2
    assert 0.07 < one.prompt_stage_time(1, 512, 1) and perf.prompt_stage_time(1, 512, 1) < 0.06
    search = PlacementSearch(perf, even(60, 8, prompt=512), SLO(ttft=0.07, tpot=0.1), 0.9,
                             GoodputSpace(max_depth=2, microbatches=(1,)))
    ranked = search.prefill_candidates()
    assert [c for _, c in ranked] == [PhaseConfig(2, 1, 1), PhaseConfig(2, 2, 1)]
    assert search.place(rate=30.0, colocated=False).prefill.config == PhaseConfig(2, 1, 1)
    with pytest.raises(ValueError):
        perf.with_tensor_parallel(3)


def test_infeasible_slo_is_a_clear_error():
    search = PlacementSearch(SplitPerf(), even(50, 10), SLO(ttft=0.5 * Y, tpot=1.0), 0.9, GoodputSpace(max_depth=2))
    with pytest.raises(Infeasible):
        search.place(rate=1.0)
    with pytest.raises(ValueError):
        PlacementSearch(SplitPerf(), even(50, 10), SLO(ttft=1.0), 0.9)

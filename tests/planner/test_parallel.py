"""The planner simulates its candidates in worker processes: the same ranking as in one process,
progress reported once per candidate, and work units that survive a spawn (pickled whole)."""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.planner import evaluate
from kvflow.planner.search import _simulate
from kvflow.simulator import LengthDist, Layout, PipelineGroup, SimConfig, synthetic

PERF = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))
LAYOUTS = [Layout(PipelineGroup(4, 8)), Layout(PipelineGroup(2, 8, 2)), Layout(PipelineGroup(2, 4, 2)),
           Layout(PipelineGroup(2, 8), PipelineGroup(2, 8))]


def _workload(b: int):
    return synthetic(120, 500, LengthDist(max_len=120), None, seed=b, group=b)


def test_processes_rank_as_one_process():
    seen = []
    one = evaluate(PERF, LAYOUTS, _workload, jobs=1)
    two = evaluate(PERF, LAYOUTS, _workload, jobs=2, progress=seen.append)
    assert [e.layout for e in one] == [e.layout for e in two]
    assert [e.summary for e in one] == [e.summary for e in two]
    assert sorted(e.layout.label() for e in seen) == sorted(lay.label() for lay in LAYOUTS)


def test_a_candidate_runs_in_a_spawned_process():
    lay = LAYOUTS[3]
    task = (0, lay, SimConfig(lay, prefix_caching=False), PERF, _workload(8))
    assert pickle.loads(pickle.dumps(task))[1] == lay
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        i, spawned = pool.submit(_simulate, task).result()
    assert i == 0 and spawned.summary == _simulate(task)[1].summary

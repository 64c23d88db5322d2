"""Appendix B sweep outputs: the saved JSON keeps each configuration's label."""

from __future__ import annotations

import json

import pytest

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.planner.report import save, sweep
from kvflow.simulator.scenario import Scenario, WorkloadSpec
from kvflow.simulator.workload import LengthDist


def test_saved_json_keeps_the_layout_label(tmp_path):
    sc = Scenario("tiny", model_shape("opt-66b"), machine("2xA100-80GB"),
                  WorkloadSpec(64, 1000, LengthDist("constant", value=20, max_len=20)), machines=(2,),
                  microbatches=(4,))
    rows = sweep(sc, AnalyticPerfModel(sc.shape, sc.machine))
    js, _ = save(rows, tmp_path / "sweep", "tiny")
    best = json.loads(js.read_text())["rows"][0]["best"]
    assert best["baseline"]["layout"] == "(2p, 4b)" and best["baseline"]["kind"] == "baseline"
    assert best["baseline-dp"]["layout"] == "(2d, 1p, 4b)"
    assert best["disaggregated"]["layout"] == "((1p, 4b), (1p, 4b))"
    assert best["disaggregated"]["makespan_s"] == rows[0].best["disaggregated"].summary.makespan_s


def test_scenario_settings_reach_the_sweep(tmp_path):
    """A scenario's memory reserve and Baseline-DP dispatch rule are what the sweep simulates."""
    from kvflow.simulator import SimConfig, simulate
    from kvflow.simulator.scenario import load_scenario

    doc = tmp_path / "s.yaml"
    doc.write_text("model: opt-66b\nmachine: 2xA100-80GB\nmachines: [4]\nmicrobatches: [4]\nmemory_reserve: 0.0\n"
                   "dispatch: round_robin\nworkload: {requests: 64, prompt_len: 1000,\n"
                   "  output: {kind: lognormal, median: 20, p90: 60, max_len: 100}}\n")
    sc = load_scenario(doc)
    assert sc.machine.memory_reserve == 0.0 and sc.dispatch == "round_robin"
    perf = AnalyticPerfModel(sc.shape, sc.machine)
    dp = sweep(sc, perf)[0].best["baseline-dp"]
    w = sc.workload.build(dp.layout.prompt.microbatch)
    assert dp.summary.makespan_s == simulate(SimConfig(dp.layout, dispatch="round_robin"), perf, w).makespan
    doc.write_text("model: opt-66b\nmachine: 2xA100-80GB\ndispatch: random\n")
    with pytest.raises(ValueError):
        load_scenario(doc)

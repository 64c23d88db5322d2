"""Appendix B sweep outputs: the saved JSON keeps each configuration's label."""

from __future__ import annotations

import json

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

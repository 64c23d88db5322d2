"""Simulator benchmarks.

  scale:    1,000 machines and 100,000 requests by default (disaggregated OPT-66B on 2xA100
            machines, and the Baseline-DP layout on the same machines), timed; plus the planner's
            answer for 64. The simulator runs the real scheduler, whose cost is per request and
            token (~100 us per simulated batch), so a million requests take ~20 minutes.
  appendix: DéjàVu Appendix B (Tables 2-5, Figures 16-19) reproduced from scenarios/*.yaml, side
            by side with the paper's configurations and its 4.2x / 2.22x mean makespan ratios.

Prints tables; writes results/simulator_*.json and .png.
    python benchmarks/simulator.py [scale|appendix|all] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.planner.report import mean_ratio, save, sweep, table
from kvflow.simulator import LengthDist, Layout, PipelineSpec, SimConfig, simulate, synthetic
from kvflow.simulator.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PAPER_RATIOS = {"baseline": 4.2, "baseline-dp": 2.22}


def scale(requests: int) -> dict:
    perf = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))
    layouts = {"disaggregated": Layout(PipelineSpec(2, 16, 140), PipelineSpec(2, 16, 360)),
               "baseline-dp": Layout(PipelineSpec(2, 16, 500))}
    out = {}
    # Offline (every request at t=0, the Appendix B setting): microbatches are full, so the event
    # count is ~ requests x mean output / microbatch passes.
    print(f"scale: {requests:,} requests on 1,000 machines, all arriving at t=0")
    for name, lay in layouts.items():
        assert lay.machines == 1000
        w = synthetic(requests, 1000, LengthDist(), rate=None, seed=1, group=16)  # Appendix B lengths
        t0 = time.perf_counter()
        res = simulate(SimConfig(lay), perf, w)
        wall = time.perf_counter() - t0
        s = res.summary()
        assert (res.completions == 1).all()
        out[name] = {"wall_s": wall, "layout": lay.label(), **s.to_dict()}
        print(f"  {name:<14} {lay.label():<34} wall {wall:7.1f} s | simulated makespan {s.makespan_s:8.0f} s, "
              f"{s.throughput_rps:.1f} req/s, ttft p50 {s.ttft_p50:.2f} s, tpot p50 {s.tpot_p50 * 1e3:.1f} ms, "
              f"util {s.utilization_mean:.0%}")
    t0 = time.perf_counter()
    plan = subprocess.run([sys.executable, "-m", "kvflow.cli.main", "plan", "--model", "opt-66b", "--machine",
                           "2xA100-80GB", "--machines", "64"], capture_output=True, text=True, check=True)
    out["plan64_wall_s"] = time.perf_counter() - t0
    print(f"  planner for 64 machines: {out['plan64_wall_s']:.1f} s (process start included)")
    print("    " + plan.stdout.strip().splitlines()[-1])
    return out


def appendix(requests: int | None) -> dict:
    out = {}
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        sc = load_scenario(path)
        if requests:
            from dataclasses import replace
            sc = replace(sc, workload=replace(sc.workload, requests=requests))
        t0 = time.perf_counter()
        rows = sweep(sc, AnalyticPerfModel(sc.shape, sc.machine))
        ratios = {k: mean_ratio(rows, k) for k in PAPER_RATIOS}
        print(f"\n== {sc.name}: {sc.shape.name} on {sc.machine.name} ({time.perf_counter() - t0:.0f} s) ==")
        print(table(rows, sc.paper))
        print(f"mean makespan / disaggregated: baseline {ratios['baseline']:.2f}x, baseline-dp {ratios['baseline-dp']:.2f}x")
        save(rows, RESULTS / f"simulator_{sc.name}", sc.name, {"ratios": ratios, "paper": sc.paper})
        out[sc.name] = {"ratios": ratios, "rows": [r.to_dict() for r in rows]}
    overall = {k: sum(v["ratios"][k] for v in out.values()) / len(out) for k in PAPER_RATIOS}
    print(f"\noverall mean makespan ratio vs disaggregated: baseline {overall['baseline']:.2f}x "
          f"(paper {PAPER_RATIOS['baseline']}x), baseline-dp {overall['baseline-dp']:.2f}x "
          f"(paper {PAPER_RATIOS['baseline-dp']}x)")
    out["overall"] = overall
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", nargs="?", default="all", choices=["scale", "appendix", "all"])
    ap.add_argument("--requests", type=int, default=100_000, help="scale run size")
    ap.add_argument("--appendix-requests", type=int, default=None, help="override scenario request counts")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.part in ("scale", "all"):
        res = scale(args.requests)
        (RESULTS / "simulator_scale.json").write_text(json.dumps(res, indent=1))
    if args.part in ("appendix", "all"):
        res = appendix(args.appendix_requests)
        (RESULTS / "simulator_appendix.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

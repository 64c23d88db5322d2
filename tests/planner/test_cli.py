"""`kvflow plan` / `kvflow simulate` end to end (small), and the layout syntax."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvflow.cli.main import main
from kvflow.cli.plan import parse_layout


def test_parse_layout():
    assert parse_layout("8p16b").label() == "(8p, 16b)"
    assert parse_layout("4x2p16b").kind == "baseline-dp"
    lay = parse_layout("2x3p16b,4x5p8b")
    assert lay.kind == "disaggregated" and lay.machines == 26
    with pytest.raises(ValueError):
        parse_layout("3p16")


def test_simulate_and_plan_commands(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--model", "opt-30b", "--machine", "4xV100-16GB", "--layout", "2p8b,2p8b",
                 "--requests", "64", "--rate", "0.5", "--fail", "20:token:0:1", "--recovery", "restart",
                 "--ttft-slo", "20", "--tpot-slo", "1", "--out", str(out)]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())["summary"]
    assert summary["requests"] == 64 and summary["machines"] == 4
    assert 0 <= summary["slo_attainment"] <= 1
    plan_json = tmp_path / "plan.json"
    assert main(["plan", "--model", "opt-66b", "--machine", "2xA100-80GB", "--machines", "4",
                 "--microbatches", "4,8,16", "--requests", "256", "--json", str(plan_json)]) == 0
    text = capsys.readouterr().out
    assert "eq. 5" in text and "recommended:" in text
    doc = json.loads(plan_json.read_text())
    assert set(doc["best"]) <= {"baseline", "baseline-dp", "disaggregated"}
    assert main(["simulate", "--layout", "bogus"]) == 2  # bad input: clear error, exit code 2


def test_plan_and_simulate_import_no_torch(tmp_path):
    """The planner and the simulator need `SamplingParams`, never the model stack: `kvflow plan` (in worker
    processes too) and `kvflow simulate` run in a fresh interpreter without importing torch."""
    code = ("import sys\n"
            "from kvflow.cli.main import main\n"
            "assert main(['plan', '--model', 'opt-66b', '--machine', '2xA100-80GB', '--machines', '4', '--jobs', '2',\n"
            "             '--microbatches', '8,16', '--requests', '64']) == 0\n"
            f"assert main(['simulate', '--layout', '2p8b,2p8b', '--requests', '32', '--out', {str(tmp_path / 'sim')!r}]) == 0\n"
            "heavy = [m for m in ('torch', 'kvflow.model.llama', 'kvflow.engine') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_simulate_takes_measured_recovery_costs(tmp_path):
    """`--recovery-costs` reads what benchmarks/fault_tolerance.py measured: a longer replacement
    start-up measurably delays the run; a file without the policy's costs is a clear error."""
    costs = {"detect_s": 0.1, "replace_s": 2.0, "restore_s": 0.5, "total_s": 2.6}
    base = ["simulate", "--model", "opt-30b", "--machine", "4xV100-16GB", "--layout", "2p8b", "--requests", "32",
            "--fail", "5:prompt:0:1", "--recovery", "resume"]
    makespan = {}
    for replace_s in (2.0, 200.0):
        f = tmp_path / f"ft{replace_s}.json"
        f.write_text(json.dumps({"recovery_costs": {"resume": {**costs, "replace_s": replace_s}}}))
        out = tmp_path / f"sim{replace_s}"
        assert main(base + ["--recovery-costs", str(f), "--out", str(out)]) == 0
        makespan[replace_s] = json.loads(out.with_suffix(".json").read_text())["summary"]["makespan_s"]
    assert makespan[200.0] >= makespan[2.0] + 190
    f = tmp_path / "none.json"
    f.write_text(json.dumps({"recovery_costs": {"resume": costs}}))
    assert main(base[:-1] + ["restart", "--recovery-costs", str(f)]) == 2


def test_plan_goal_goodput(tmp_path, capsys):
    """`--goal goodput`: DistServe's Algorithm 1 — per-phase configurations, replica counts for
    --rate, the whole placement's simulated attainment, and the colocated comparison."""
    out = tmp_path / "goodput.json"
    assert main(["plan", "--goal", "goodput", "--model", "opt-13b", "--machine", "1xA100-80GB", "--machines", "8",
                 "--rate", "6", "--ttft-slo", "0.4", "--tpot-slo", "0.06", "--prompt-len", "512",
                 "--output", "constant:16", "--max-output", "16", "--microbatches", "1,4,16", "--max-depth", "1",
                 "--trial-requests", "60", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prefill"]["config"].startswith("(1p, 1tp") and doc["decode"]["config"].startswith("(1p, 1tp")
    assert doc["prefill"]["instances"] >= -(-6 // doc["prefill"]["goodput"])
    assert doc["devices"] == doc["prefill"]["instances"] + doc["decode"]["instances"] <= 8
    assert doc["attainment"] >= 0.9 or doc["notes"]
    assert doc["colocated"]["per_device"] > 0
    assert "placement:" in capsys.readouterr().out
    assert main(["plan", "--goal", "goodput", "--machines", "8", "--rate", "6"]) == 2  # SLOs missing


def test_plan_writes_a_ray_placement_that_serve_takes(tmp_path, capsys):
    import shlex

    from kvflow.cli.main import build_parser
    from kvflow.config import pipeline_specs
    from kvflow.controller.ray_launcher import Placement

    placement, plan_json = tmp_path / "placement.json", tmp_path / "plan.json"
    nodes = [f"10.0.0.{i}" for i in range(1, 5)]
    assert main(["plan", "--model", "opt-66b", "--machine", "2xA100-80GB", "--machines", "4", "--microbatches", "4,8",
                 "--requests", "32", "--output", "constant:16", "--placement", str(placement), "--ray-nodes", ",".join(nodes),
                 "--json", str(plan_json)]) == 0
    doc = json.loads(plan_json.read_text())["placement"]
    pl = Placement.load(placement)  # what `kvflow serve --plan` reads
    argv = shlex.split(doc["command"])
    flag = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}
    assert argv[:2] == ["kvflow", "serve"] and flag["--launcher"] == "ray" and flag["--plan"] == str(placement)
    build_parser().parse_args(argv[1:])  # the printed command is one `kvflow serve` accepts
    if flag["--mode"] == "colocated":
        specs = pipeline_specs("colocated", int(flag["--depth"]), 0, 0, int(flag["--token-microbatch"]), 0)
    else:
        specs = pipeline_specs("disaggregated", 0, int(flag["--prompt-depth"]), int(flag["--token-depth"]),
                               int(flag["--token-microbatch"]), int(flag["--prompt-microbatch"]))
    names = [s.stage_name(i) for s in specs for i in range(s.depth)]
    assert list(pl.stages) == names  # every stage of the served configuration, in order
    assert [pl.stages[n].node_ip for n in names] == [nodes[i % len(nodes)] for i in range(len(names))]
    assert main(["plan", "--machines", "4", "--placement", str(placement)]) == 2  # no --ray-nodes: clear error

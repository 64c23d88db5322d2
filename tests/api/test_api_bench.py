"""`kvflow bench serve`: request generation (lengths, arrivals, traces) and a short real run against the tiny server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from api_helpers import tiny_backend

from kvflow.api.server import BackgroundServer
from kvflow.bench.client import RequestResult
from kvflow.bench.dataset import DatasetSpec, build_requests
from kvflow.bench.report import max_sustained_rate, summarize
from kvflow.cli.main import main
from kvflow.simulator.workload import LengthDist
from kvflow.slo import SLO

TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "AzureLLMInferenceTrace_conv_first1000.csv"


def test_synthetic_requests_are_seeded_and_fit_the_context():
    spec = DatasetSpec(num_requests=400, prompt_len=100, seed=3)
    a, b = build_requests(spec, 1.0, vocab_size=1000, max_model_len=512), build_requests(spec, 4.0, 1000, 512)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    assert np.allclose([r.arrival for r in a], [4 * r.arrival for r in b]) and a[0].arrival == 0.0
    assert all(len(r.prompt_token_ids) == 100 and 125 <= min(r.prompt_token_ids) for r in a)
    outs = np.array([r.max_tokens for r in a])
    assert outs.max() <= 412 and outs.min() >= 1
    assert 100 < np.median(outs) < 190  # LMSys-like: median 141 (before the context cap)
    gaps = np.diff([r.arrival for r in a])
    assert 0.8 < gaps.mean() < 1.2  # Poisson at 1 req/s
    c = build_requests(DatasetSpec(num_requests=5, prompt_len=8, output=LengthDist("constant", value=7)), 2.0, 96, 256)
    assert [r.max_tokens for r in c] == [7] * 5
    with pytest.raises(ValueError, match="no room"):
        build_requests(DatasetSpec(prompt_len=300), 1.0, 96, 256)


def test_azure_trace_is_scaled():
    spec = DatasetSpec(num_requests=20, trace=TRACE, length_scale=0.1, output_scale=0.5, max_output_len=50, trace_arrivals=True)
    reqs = build_requests(spec, 2.0, 49152, 2048)
    assert len(reqs) == 20
    rows = TRACE.read_text().splitlines()[1:21]
    ctx = [int(r.split(",")[1]) for r in rows]
    gen = [int(r.split(",")[2]) for r in rows]
    assert sorted(len(r.prompt_token_ids) for r in reqs) == sorted(max(1, round(c * 0.1)) for c in ctx)
    assert sorted(r.max_tokens for r in reqs) == sorted(min(50, max(1, round(g * 0.5))) for g in gen)
    arrivals = [r.arrival for r in reqs]
    assert arrivals[0] == 0.0 and abs(20 / arrivals[-1] - 2.0) < 1e-6  # the trace's timing stretched to 2 req/s


def test_summary_percentiles_and_goodput():
    rs = [RequestResult(True, 10, 11, 11, ttft=0.1 * i, latency=0.1 * i + 1.0) for i in range(1, 11)]
    rs.append(RequestResult(False, 10, error="boom"))
    s = summarize(2.0, rs, num_sent=11, num_planned=12, duration=5.0, slo=SLO(ttft=0.5, tpot=0.2))
    assert (s["completed"], s["failed"], s["unfinished"], s["planned"]) == (10, 1, 0, 12)
    assert s["request_throughput"] == pytest.approx(2.0) and s["output_token_throughput"] == pytest.approx(22.0)
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)
    assert s["normalized_latency_s_per_token"]["p50"] == pytest.approx(1.55 / 11)
    assert s["goodput_req_per_s"] == pytest.approx(5 / 5.0)  # ttft 0.1..0.5 meet the SLO
    assert max_sustained_rate([s], 1.0) is None  # not every planned request completed


def test_bench_serve_against_real_server(tiny_ckpt_dir, tmp_path, capsys):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        rc = main(["bench", "serve", "--url", srv.url, "--rates", "4,16", "--num-requests", "6", "--prompt-len", "12",
                   "--output-scale", "0.1", "--max-output-len", "24", "--ttft-slo", "5", "--tpot-slo", "1",
                   "--latency-bound", "1", "--out", str(tmp_path / "bench"), "--no-progress", "--max-duration", "60"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "goodput" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert [r["rate"] for r in doc["runs"]] == [4.0, 16.0]
    for run in doc["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["errors"] == []
        for req in run["requests"]:
            assert req["ok"] and req["output_len"] == req["expected_output_len"] and req["prompt_len"] == 12  # ignore_eos honoured
        for key in ("ttft_s", "tpot_s", "normalized_latency_s_per_token", "latency_s"):
            assert 0 < run[key]["p50"] <= run[key]["p90"] <= run[key]["p99"]
        assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
        assert run["goodput_req_per_s"] == pytest.approx(run["request_throughput"])  # loose SLOs: everything is good
    assert doc["max_sustained_rate"] == 16.0
    # a second configuration drawn beside the first (as Baseline-2 vs kvflow-1-1 in DéjàVu Figure 8)
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        assert main(["bench", "serve", "--url", srv.url, "--rates", "8", "--num-requests", "3", "--prompt-len", "12",
                     "--output-dist", "constant:5", "--label", "other", "--compare", str(tmp_path / "bench.json"),
                     "--temperature", "1", "--out", str(tmp_path / "other"), "--no-progress"]) == 0
    other = json.loads((tmp_path / "other.json").read_text())
    assert other["config"]["compare"] == [str(tmp_path / "bench.json")]
    assert other["config"]["temperature"] == 1.0 and doc["config"]["temperature"] == 0.0
    assert [r["output_len"] for r in other["runs"][0]["requests"]] == [5, 5, 5]
    assert (tmp_path / "other.png").stat().st_size > 1000


def test_bench_rejects_remote_targets_and_bad_flags(capsys):
    assert main(["bench", "serve", "--url", "http://10.1.2.3:8000"]) == 2
    assert "only targets 127.0.0.1/localhost" in capsys.readouterr().err
    assert main(["bench", "serve", "--rates", "1,x"]) == 2
    assert main(["bench", "serve", "--rates", "0"]) == 2
    assert main(["bench", "serve", "--output-dist", "zipf"]) == 2
    assert main(["bench", "serve", "--temperature", "-1"]) == 2
    assert "--output-dist" in capsys.readouterr().err

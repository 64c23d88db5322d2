"""Summaries of a load-generator run: throughput, TTFT/TPOT/normalized-latency percentiles, goodput; table, JSON, PNG;
and where every benchmark writes its results (`write_results`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvflow.bench.client import RequestResult
from kvflow.slo import SLO

PCTS = (50, 90, 99)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PCTS}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}}


def summarize(rate: float, results: list[RequestResult], num_sent: int, num_planned: int, duration: float, slo: SLO) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    good = int(slo.met([r.ttft for r in ok], [r.tpot or 0.0 for r in ok]).sum())  # (one-token answers have no TPOT)
    errors = sorted({r.error for r in results if r.error})[:5]
    return {
        "rate": rate,
        "planned": num_planned,
        "sent": num_sent,
        "completed": len(ok),
        "failed": sum(1 for r in results if not r.ok),
        "unfinished": num_sent - len(results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "normalized_latency_s_per_token": _stats([r.normalized_latency for r in ok if r.normalized_latency is not None]),
        "latency_s": _stats([r.latency for r in ok if r.latency is not None]),
        "slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot},
        "goodput_req_per_s": good / duration if duration > 0 else 0.0,
        "slo_attainment": good / num_sent if num_sent else 0.0,
        "errors": errors,
        "requests": [r.to_json() for r in results],
    }


def max_sustained_rate(summaries: list[dict], bound: float) -> float | None:
    """Highest rate whose every request completed with median normalized latency <= `bound` s/token."""
    ok = [s["rate"] for s in summaries if s["completed"] == s["planned"] and
          (s["normalized_latency_s_per_token"]["p50"] or float("inf")) <= bound]
    return max(ok) if ok else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def table(summaries: list[dict]) -> str:
    head = (f"{'rate':>6} {'done':>9} {'req/s':>6} {'tok/s':>7} {'TTFT ms p50/p90/p99':>21} "
            f"{'TPOT ms p50/p90/p99':>20} {'norm.lat ms/tok p50/p90/p99':>28} {'goodput':>8}")
    rows = [head, "-" * len(head)]
    for s in summaries:
        t, p, n = s["ttft_s"], s["tpot_s"], s["normalized_latency_s_per_token"]
        trip = lambda d: "/".join(_ms(d[f"p{q}"]) for q in PCTS)  # noqa: E731
        rows.append(f"{s['rate']:>6g} {s['completed']:>4}/{s['planned']:<4} {s['request_throughput']:>6.2f} "
                    f"{s['output_token_throughput']:>7.1f} {trip(t):>21} {trip(p):>20} {trip(n):>28} {s['goodput_req_per_s']:>8.2f}")
    return "\n".join(rows)


def save(summaries: list[dict], config: dict, out: Path, bound: float | None, compare: tuple[Path, ...] = ()) -> tuple[Path, Path]:
    """Writes `out`.json (config, per-rate summaries with per-request records) and `out`.png.

    `compare`: earlier JSON files of this command (other configurations) drawn on the same plot.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out.with_suffix(".json"), out.with_suffix(".png")
    series = {}
    for path in compare:
        other = json.loads(Path(path).read_text())
        series[other["config"].get("label", Path(path).stem)] = other["runs"]
    series[config.get("label", "kvflow")] = summaries
    doc = {"config": config, "max_sustained_rate": max_sustained_rate(summaries, bound) if bound else None, "runs": summaries}
    jpath.write_text(json.dumps(doc, indent=1))
    plot(series, ppath, bound)
    return jpath, ppath


def write_results(stem: Path, doc: dict, draw=None) -> list[Path]:
    """A benchmark's outputs: `stem`.json (`doc`; paths and other values JSON lacks as text), then, given
    `draw` (pyplot -> a figure), `stem`.png of its figure (laid out, 120 dpi, closed). The JSON comes
    first: a plot that fails (no matplotlib) loses no measurement. Prints and returns the paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".json")]
    paths[0].write_text(json.dumps(doc, indent=1, default=str))
    if draw is not None:
        from kvflow.plotting import pyplot

        plt = pyplot()
        fig = draw(plt)
        paths.append(stem.with_suffix(".png"))
        fig.tight_layout()
        fig.savefig(paths[1], dpi=120)
        plt.close(fig)
    print("wrote " + " and ".join(map(str, paths)))
    return paths


def plot(series: dict[str, list[dict]], path: Path, bound: float | None) -> None:
    """Median (solid) and p90 (dashed) normalized latency vs request rate, one colour per configuration."""
    from kvflow.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, (label, summaries) in enumerate(series.items()):
        rates = [s["rate"] for s in summaries]
        med = [s["normalized_latency_s_per_token"]["p50"] for s in summaries]
        p90 = [s["normalized_latency_s_per_token"]["p90"] for s in summaries]
        ax.plot(rates, [np.nan if v is None else v for v in med], "o-", color=f"C{i}", label=f"{label} median")
        ax.plot(rates, [np.nan if v is None else v for v in p90], "x--", color=f"C{i}", alpha=0.5, label=f"{label} p90")
    if bound:
        ax.axhline(bound, color="grey", lw=0.8, ls=":", label=f"bound {bound:g} s/token")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title("Normalized latency vs request rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

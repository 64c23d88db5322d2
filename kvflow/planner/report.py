"""Appendix B sweeps over cluster sizes, and their table / JSON / PNG outputs (DéjàVu Figs. 16-19)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from kvflow.perf.perf_model import PerfModel
from kvflow.planner.search import Evaluated, SearchSpace, best_per_kind
from kvflow.simulator.scenario import Scenario

KINDS = ("baseline", "baseline-dp", "disaggregated")


@dataclass(frozen=True)
class SweepRow:
    machines: int
    best: dict[str, Evaluated]

    def to_dict(self) -> dict:
        return {"machines": self.machines,
                "best": {k: e.to_dict() for k, e in self.best.items()}}


def sweep(scenario: Scenario, perf: PerfModel, progress=None) -> list[SweepRow]:
    """For every cluster size of the scenario: the shortest-makespan configuration of each kind.
    `progress(row, seconds)`, when given, is called after each cluster size (long sweeps)."""
    w = scenario.workload
    space = SearchSpace(w.prompt_len, w.max_tokens, w.mean_output, scenario.microbatches, scenario.swapping)
    rows = []
    for d in scenario.machines:
        t0 = time.perf_counter()
        rows.append(SweepRow(d, best_per_kind(perf, d, space, lambda b: w.build(b), scenario.dispatch)))
        if progress is not None:
            progress(rows[-1], time.perf_counter() - t0)
    return rows


def table(rows: list[SweepRow], paper: dict | None = None) -> str:
    """One line per cluster size: each kind's chosen configuration and makespan, "= paper" or
    "~ paper CONFIG" when the paper's Table 2-5 configuration is known, and the makespan ratios."""
    paper = paper or {}
    head = f"{'D':>3} | " + " | ".join(f"{k:<44}" for k in KINDS) + " | base/dis  dp/dis"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k in KINDS:
            e, p = r.best.get(k), paper.get(r.machines, {}).get(k)
            cell = f"{e.layout.label()} {e.summary.makespan_s:.0f}s" if e else "infeasible"
            if p:
                cell += " = paper" if e and e.layout.label() == p else f" ~ {p}"
            cells.append(f"{cell:<44}")
        ratios = "".join(f"{x:8.2f}" if x is not None else "       -" for x in (ratio(r, "baseline"), ratio(r, "baseline-dp")))
        lines.append(f"{r.machines:>3} | " + " | ".join(cells) + " |" + ratios)
    return "\n".join(lines)


def ratio(row: SweepRow, kind: str) -> float | None:
    """makespan(kind) / makespan(disaggregated) of one cluster size, None where either is infeasible."""
    if kind not in row.best or "disaggregated" not in row.best:
        return None
    return row.best[kind].summary.makespan_s / row.best["disaggregated"].summary.makespan_s


def mean_ratio(rows: list[SweepRow], kind: str, min_machines: int = 1) -> float | None:
    """Arithmetic mean of makespan(kind) / makespan(disaggregated) over the cluster sizes of at
    least `min_machines` where both exist."""
    vals = [x for r in rows if r.machines >= min_machines and (x := ratio(r, kind)) is not None]
    return sum(vals) / len(vals) if vals else None


def matches(rows: list[SweepRow], paper: dict, kind: str) -> tuple[int, int]:
    """(configurations equal to the paper's, configurations the paper lists) for `kind`."""
    pairs = [(r.best.get(kind), paper[r.machines][kind]) for r in rows if kind in paper.get(r.machines, {})]
    return sum(1 for e, p in pairs if e is not None and e.layout.label() == p), len(pairs)


def save(rows: list[SweepRow], out: Path, title: str, extra: dict | None = None) -> tuple[Path, Path]:
    """Write `out`.json and `out`.png (makespan and machine-hours vs machines for each kind)."""
    from kvflow.plotting import pyplot

    out.parent.mkdir(parents=True, exist_ok=True)
    js, png = out.with_suffix(".json"), out.with_suffix(".png")
    js.write_text(json.dumps({"title": title, "rows": [r.to_dict() for r in rows], **(extra or {})}, indent=1))
    plt = pyplot()  # after the JSON: without matplotlib the numbers are still written
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for k in KINDS:
        pts = [(r.machines, r.best[k].summary) for r in rows if k in r.best]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1].makespan_s for p in pts], marker="o", label=k)
            ax2.plot([p[0] for p in pts], [p[1].machine_hours for p in pts], marker="o", label=k)
    ax1.set(xlabel="machines", ylabel="makespan (s)", title=title)
    ax2.set(xlabel="machines", ylabel="cost (machine-hours)", title="normalized cost")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return js, png

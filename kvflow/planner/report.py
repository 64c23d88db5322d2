"""Appendix B sweeps over cluster sizes, and their table / JSON / PNG outputs (DéjàVu Figs. 16-19)."""

from __future__ import annotations

import json
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


def sweep(scenario: Scenario, perf: PerfModel) -> list[SweepRow]:
    """For every cluster size of the scenario: the shortest-makespan configuration of each kind."""
    w = scenario.workload
    space = SearchSpace(w.prompt_len, w.max_tokens, w.mean_output, scenario.microbatches, scenario.swapping)
    return [SweepRow(d, best_per_kind(perf, d, space, lambda b: w.build(b))) for d in scenario.machines]


def table(rows: list[SweepRow], paper: dict | None = None) -> str:
    head = f"{'D':>3} | " + " | ".join(f"{k:<34}" for k in KINDS) + " | base/dis  dp/dis"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k in KINDS:
            e = r.best.get(k)
            cell = f"{e.layout.label()} {e.summary.makespan_s:8.1f}s" if e else "infeasible"
            cells.append(f"{cell:<34}")
        dis = r.best.get("disaggregated")
        ratios = "".join(f"{r.best[k].summary.makespan_s / dis.summary.makespan_s:8.2f}" if dis and k in r.best
                         else "       -" for k in ("baseline", "baseline-dp"))
        lines.append(f"{r.machines:>3} | " + " | ".join(cells) + " |" + ratios)
        if paper and r.machines in paper:
            p = paper[r.machines]
            lines.append("    | " + " | ".join(f"{'paper ' + p.get(k, '-'):<34}" for k in KINDS) + " |")
    return "\n".join(lines)


def mean_ratio(rows: list[SweepRow], kind: str) -> float | None:
    """Geometric-free arithmetic mean of makespan(kind) / makespan(disaggregated) where both exist."""
    vals = [r.best[kind].summary.makespan_s / r.best["disaggregated"].summary.makespan_s
            for r in rows if kind in r.best and "disaggregated" in r.best]
    return sum(vals) / len(vals) if vals else None


def save(rows: list[SweepRow], out: Path, title: str, extra: dict | None = None) -> tuple[Path, Path]:
    """Write `out`.json and `out`.png (makespan and machine-hours vs machines for each kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    js, png = out.with_suffix(".json"), out.with_suffix(".png")
    js.write_text(json.dumps({"title": title, "rows": [r.to_dict() for r in rows], **(extra or {})}, indent=1))
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

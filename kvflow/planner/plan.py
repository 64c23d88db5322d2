"""`recommend`: the planner's answer for a model, machine type, cluster size and workload — the
Appendix D numbers that explain it, and simulator-checked best layouts of each kind."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from kvflow.perf.perf_model import PerfModel
from kvflow.planner.formulas import (Infeasible, colocated_inverse_throughput, disaggregation_threshold,
                                     min_prompt_depth, min_token_depth)
from kvflow.planner.search import (Evaluated, SearchSpace, analytic_throughput, colocated_layouts,
                                   disaggregated_layouts, evaluate, formula_split)
from kvflow.simulator.workload import Workload


@dataclass(frozen=True)
class FormulaReport:
    """Appendix D evaluated for one microbatch size over `machines` machines (bytes, seconds)."""

    microbatch: int
    memory: float  # M: usable device memory per machine
    layer_weight: float  # W0
    prompt_kv: float  # C0: one layer's prompt KV for a microbatch
    token_kv: float  # K0: one layer's generated-token KV for a microbatch (reserved maximum)
    min_prompt_depth: int  # eq. 2
    min_token_depth: int  # eq. 3
    y: float  # per-stage prompt time at depth D
    t: float  # per-stage token time at depth D
    n: float  # mean generated tokens
    m: float  # streaming overhead
    inv_colocated: float  # eq. 4
    threshold: float  # eq. 5 right-hand side
    d_p: float  # eq. 7
    d_t: float  # eq. 6
    prompt_machines: int
    token_machines: int
    inv_disaggregated: float

    @property
    def disaggregation_wins(self) -> bool:
        return self.y / self.t > self.threshold


@dataclass(frozen=True)
class Plan:
    machines: int
    formulas: FormulaReport
    best: dict[str, Evaluated]  # kind -> shortest-makespan simulated layout
    simulated: int
    reasons: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> Evaluated:
        return min(self.best.values(), key=lambda e: e.summary.makespan_s)


def formula_report(perf: PerfModel, machines: int, batch: int, space: SearchSpace) -> FormulaReport:
    s = perf.shape
    w0 = s.layer_weight_bytes
    c0 = batch * space.prompt_len * s.kv_bytes_per_token_layer
    k0 = batch * (space.max_tokens - space.prompt_len) * s.kv_bytes_per_token_layer
    mem = perf.machine.usable_memory
    split, (y, t, m) = formula_split(perf, machines, batch, space)
    depth = min(machines, s.layers)
    return FormulaReport(
        batch, mem, w0, c0, k0, min_prompt_depth(s.layers, w0, c0, mem), min_token_depth(s.layers, w0, c0, k0, mem),
        y, t, space.mean_output, m, colocated_inverse_throughput(depth, y, t, space.mean_output),
        disaggregation_threshold(machines, m), split.d_p, split.d_t, split.prompt_machines,
        split.token_machines, split.inverse_throughput)


def recommend(perf: PerfModel, machines: int, space: SearchSpace, workload_for: Callable[[int], Workload],
              top_k: int = 3, jobs: int | None = None, progress: Callable[[Evaluated], None] | None = None) -> Plan:
    """Enumerate feasible layouts, rank them with the formulas, simulate the `top_k` of each kind
    on `workload_for(microbatch)` (in `jobs` processes, with `progress` lines: `evaluate`), and
    explain the winner."""
    if machines < 1:
        raise ValueError("need at least one machine")
    candidates = colocated_layouts(perf, machines, space) + disaggregated_layouts(perf, machines, space)
    if not candidates:
        raise Infeasible(f"{perf.shape.name} does not fit on {machines} x {perf.machine.name} with the "
                         f"microbatch sizes {space.microbatches}")
    ranked: dict[str, list] = {}
    for lay in candidates:
        ranked.setdefault(lay.kind, []).append((analytic_throughput(perf, lay, space) / lay.machines, lay))
    shortlist = [lay for group in ranked.values()
                 for _, lay in sorted(group, key=lambda x: -x[0])[:top_k]]
    best: dict[str, Evaluated] = {}
    for e in evaluate(perf, shortlist, workload_for, space.swapping, jobs=jobs, progress=progress):
        best.setdefault(e.layout.kind, e)
    b = max((lay.prompt.microbatch for lay in candidates), key=lambda x: x)
    rec = min(best.values(), key=lambda e: e.summary.makespan_s)
    b = rec.layout.prompt.microbatch
    try:
        report = formula_report(perf, machines, b, space)
    except Infeasible:
        report = formula_report(perf, max(2, machines), b, space)
    return Plan(machines, report, best, len(shortlist), _reasons(report, best, rec))


def _reasons(f: FormulaReport, best: dict[str, Evaluated], rec: Evaluated) -> list[str]:
    gb = 1e9
    out = [
        f"memory per machine M = {f.memory / gb:.1f} GB, layer weights W0 = {f.layer_weight / gb:.2f} GB, "
        f"prompt KV C0 = {f.prompt_kv / gb:.3f} GB, token KV K0 = {f.token_kv / gb:.3f} GB per layer (b={f.microbatch})",
        f"eq. 2: prompt pipeline depth >= {f.min_prompt_depth}; eq. 3: token pipeline depth >= {f.min_token_depth}",
        f"per-stage prompt time Y = {f.y * 1e3:.1f} ms, token step t = {f.t * 1e3:.2f} ms, Y/t = {f.y / f.t:.1f}, "
        f"N = {f.n:.0f} tokens, streaming overhead m = {f.m:.3f}",
        f"eq. 5: disaggregation beats colocation iff Y/t > {f.threshold:.3f} -> "
        f"{'yes' if f.disaggregation_wins else 'no'}",
        f"eqs. 6-7: D_p = {f.d_p:.2f}, D_t = {f.d_t:.2f} -> {f.prompt_machines} prompt + {f.token_machines} token machines; "
        f"inverse throughput per microbatch: colocated (eq. 4) {f.inv_colocated:.2f} s, "
        f"disaggregated {f.inv_disaggregated:.2f} s",
    ]
    for kind, e in sorted(best.items()):
        out.append(f"simulated best {kind}: {e.layout.label()} makespan {e.summary.makespan_s:.1f} s, "
                   f"utilization {e.summary.utilization_mean:.0%}")
    others = [e for e in best.values() if e is not rec]
    if others:
        runner = min(others, key=lambda e: e.summary.makespan_s)
        out.append(f"recommended: {rec.layout.kind} {rec.layout.label()} — {runner.summary.makespan_s / rec.summary.makespan_s:.2f}x "
                   f"shorter makespan than the best {runner.layout.kind}")
    else:
        out.append(f"recommended: {rec.layout.kind} {rec.layout.label()} (the only feasible kind)")
    if not math.isfinite(f.threshold):
        out.append("note: with this m or a single machine, eq. 5 rules out disaggregation")
    return out

"""Configuration search (DéjàVu Appendix B): enumerate memory-feasible Baseline, Baseline-DP and
disaggregated layouts for D machines, prune the disaggregated splits with eqs. 6-7, and let the
simulator pick the one with the shortest makespan for a workload."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

from kvflow.perf.perf_model import PerfModel
from kvflow.planner.formulas import Infeasible, balanced_split, streaming_overhead
from kvflow.simulator.config import BLOCK_SIZE, Layout, PipelineGroup, SimConfig
from kvflow.simulator.metrics import Summary
from kvflow.simulator.simulator import simulate
from kvflow.simulator.workload import Workload


@dataclass(frozen=True)
class SearchSpace:
    """What may vary. `max_tokens` is reserved per request (prompt + longest output); `mean_output`
    is N in the formulas; `max_depth` caps a pipeline (planner mode, where pipelines replicate)."""

    prompt_len: int
    max_tokens: int
    mean_output: float
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    swapping: bool = False
    replicate: bool = False  # disaggregated: replicate prompt/token pipelines instead of one each
    max_depth: int = 64
    window: int = 2  # disaggregated splits tried on each side of the eqs. 6-7 optimum

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_tokens <= self.prompt_len or self.mean_output < 1:
            raise ValueError("need prompt_len >= 1, max_tokens > prompt_len, mean_output >= 1")
        if not self.microbatches or min(self.microbatches) < 1:
            raise ValueError("microbatch candidates must be >= 1")


def fits(perf: PerfModel, depth: int, batch: int, tokens: int, slots: int) -> bool:
    """True when one stage of a `depth` pipeline holds its weights and `slots` microbatches of KV,
    each request holding `tokens` tokens in the simulator's blocks (`PerfModel.kv_capacity_tokens`
    sizes the simulated pools too)."""
    if depth > perf.shape.layers:
        return False
    return perf.max_microbatch(depth, tokens, slots, BLOCK_SIZE) >= batch


def _token_slots(space: SearchSpace, depth: int) -> int:
    return min(2, depth) if space.swapping else depth


def colocated_layouts(perf: PerfModel, machines: int, space: SearchSpace) -> list[Layout]:
    """Baseline (one pipeline of all machines) and Baseline-DP (d pipelines of machines/d)."""
    out = []
    for d in range(1, machines + 1):
        if machines % d or machines // d > space.max_depth:
            continue
        depth = machines // d
        for b in space.microbatches:
            if fits(perf, depth, b, space.max_tokens, _token_slots(space, depth)):
                out.append(Layout(PipelineGroup(depth, b, d)))
    return out


def formula_split(perf: PerfModel, machines: int, batch: int, space: SearchSpace):
    """Eqs. 6-7 for `machines` split into a prompt and a token side, with times at depth D."""
    depth = min(machines, perf.shape.layers)
    y = perf.prompt_stage_time(batch, space.prompt_len, depth)
    t = perf.token_stage_time(batch, int(space.prompt_len + space.mean_output / 2), depth)
    m = streaming_overhead(perf.kv_transfer_time(batch * space.prompt_len, depth), y)
    return balanced_split(machines, y, t, space.mean_output, m), (y, t, m)


def disaggregated_layouts(perf: PerfModel, machines: int, space: SearchSpace) -> list[Layout]:
    """One prompt and one token pipeline (Appendix B), or, with `replicate`, replicas of bounded
    depth; splits within `window` machines of the eqs. 6-7 balance point."""
    out = []
    for b in space.microbatches:
        try:
            split, _ = formula_split(perf, machines, b, space)
        except Infeasible:
            continue
        lo = max(1, split.prompt_machines - space.window)
        hi = min(machines - 1, split.prompt_machines + space.window)
        for n_p in range(lo, hi + 1):
            n_t = machines - n_p
            for pspec, tspec in _shapes(perf, n_p, n_t, b, space):
                out.append(Layout(pspec, tspec))
    return out


def _shapes(perf: PerfModel, n_p: int, n_t: int, b: int, space: SearchSpace):
    """Pipeline shapes for n_p prompt and n_t token machines: the shallowest feasible depth."""
    def shallowest(n: int, tokens: int, slots_of) -> PipelineGroup | None:
        depths = [n] if not space.replicate else [d for d in range(1, min(n, space.max_depth) + 1)]
        for depth in depths:
            if fits(perf, depth, b, tokens, slots_of(depth)):
                return PipelineGroup(depth, b, n // depth)
        return None
    # The microbatch policy reserves prompt + max_tokens at admission on the prompt side too.
    p = shallowest(n_p, space.max_tokens, lambda d: d)
    t = shallowest(n_t, space.max_tokens, lambda d: _token_slots(space, d))
    return [(p, t)] if p and t else []


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    summary: Summary

    def to_dict(self) -> dict:
        """The summary's numbers with `layout` the configuration's label (as in the paper's tables,
        e.g. "(3d, 2p, 16b)") and `kind` its kind; the summary's own "kind label" string would
        otherwise overwrite the label."""
        return {**self.summary.to_dict(), "layout": self.layout.label(), "kind": self.layout.kind}


def _simulate(task: tuple[int, Layout, SimConfig, PerfModel, Workload]) -> tuple[int, Evaluated]:
    """One candidate (a worker process's unit of work: module-level, its arguments picklable)."""
    i, lay, cfg, perf, w = task
    return i, Evaluated(lay, simulate(cfg, perf, w).summary())


def evaluate(perf: PerfModel, layouts: list[Layout], workload_for: Callable[[int], Workload],
             swapping: bool = False, dispatch: str = "shared", jobs: int | None = None,
             progress: Callable[[Evaluated], None] | None = None) -> list[Evaluated]:
    """Simulate each layout on `workload_for(microbatch)`; return them by makespan, best first.
    Without prefix caching: simulated requests never share a prefix (each has token ids of its
    own), so the pools' hashing would decide nothing and cost a fifth of the run.

    The candidates are independent runs: `jobs` worker processes (default `os.cpu_count()`; 1: in
    this process) simulate them, each given its layout, config, performance model and workload
    (the workloads are built here, once per microbatch size). `progress(evaluated)` is called here
    as each candidate finishes, in the order they finish."""
    workloads: dict[int, Workload] = {}
    tasks = []
    for lay in layouts:
        b = lay.prompt.microbatch
        if b not in workloads:
            workloads[b] = workload_for(b)
        cfg = SimConfig(lay, dispatch="shared" if lay.disaggregated else dispatch, swapping=swapping, prefix_caching=False)
        tasks.append((len(tasks), lay, cfg, perf, workloads[b]))
    jobs = min(jobs or os.cpu_count() or 1, len(tasks))
    res: list[tuple[int, Evaluated]] = []

    def done(i: int, e: Evaluated) -> None:
        res.append((i, e))
        if progress is not None:
            progress(e)

    if jobs <= 1:
        for task in tasks:
            done(*_simulate(task))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            for f in as_completed([pool.submit(_simulate, task) for task in tasks]):
                done(*f.result())
    res.sort(key=lambda r: (r[1].summary.makespan_s, r[1].layout.machines, r[0]))  # ties: in the order given
    return [e for _, e in res]


def best_per_kind(perf: PerfModel, machines: int, space: SearchSpace, workload_for: Callable[[int], Workload],
                  dispatch: str = "shared", jobs: int | None = None) -> dict[str, Evaluated]:
    """Appendix B: the shortest-makespan Baseline, Baseline-DP and disaggregated configuration
    (`jobs` as in `evaluate`)."""
    best: dict[str, Evaluated] = {}
    layouts = colocated_layouts(perf, machines, space) + disaggregated_layouts(perf, machines, space)
    for e in evaluate(perf, layouts, workload_for, space.swapping, dispatch, jobs):
        best.setdefault(e.layout.kind, e)
    return best


def analytic_throughput(perf: PerfModel, layout: Layout, space: SearchSpace) -> float:
    """Requests/s predicted by the Appendix D formulas (no early stops, no queueing)."""
    from kvflow.planner.formulas import colocated_inverse_throughput, streaming_overhead

    n = space.mean_output
    ctx = int(space.prompt_len + n / 2)
    p = layout.prompt
    y = perf.prompt_stage_time(p.microbatch, space.prompt_len, p.depth)
    if layout.token is None:
        t = perf.token_stage_time(p.microbatch, ctx, p.depth)
        return p.count * p.microbatch / colocated_inverse_throughput(p.depth, y, t, n)
    tk = layout.token
    m = streaming_overhead(perf.kv_transfer_time(p.microbatch * space.prompt_len, p.depth), y)
    t = perf.token_stage_time(tk.microbatch, ctx, tk.depth)
    return min(p.count * p.microbatch / (m * y), tk.count * tk.microbatch / (n * t))

"""Fidelity out of sample: does the simulator, calibrated by `kvflow profile`, predict the server?

1. Calibrate: `kvflow profile` (the real single-process engine, one torch thread) on its own grid of
   shapes (`kvflow.perf.calibrate.GRID_*`: whole prompts in small batches, decode steps at a few
   contexts) — never the replay's requests or its mixed, chunked batches — plus the
   overhead of worker processes (`calibrate.executor_overhead`: decode steps of 1, 2 and 4 requests
   through one- and two-stage worker pipelines, the client's token gap minus the workers' own
   compute time of the same steps: a pass's cost, its cost per sequence, and per further stage) and the slowdown of a prefill and a decode step beside another busy engine process
   (`calibrate.co_run_slowdown`).
2. Replay one open-loop Poisson workload (prompt and output lengths from the Azure conversation
   trace, its first requests (benchmarks/traces/), scaled to a 135M model on a shared 2-core CPU: prompts / 16 clipped
   to [8, 160] tokens, outputs / 8 clipped to [4, 40]; Poisson arrivals at --rate) through the real
   server: engine mode (`EngineBackend`, in-process), colocated depth 2 and disaggregated (1, 1)
   (`Controller` with real worker processes, one torch thread each). Greedy, `ignore_eos`, so every
   request produces exactly its trace output length.
3. Simulate the same workload and configuration (`SimConfig.from_cluster`: policy, scheduler
   settings, block pool) with the profiled model — the worker layouts with `shared_host` (every
   worker on this host: a step beside a busy stage runs at the co-run slowdown) — and report the
   error of throughput (output tokens/s over the makespan), median TTFT and median TPOT per layout,
   and for comparison the error with a machine per worker. With `--repeats N` every layout is
   replayed N times (rounds interleaved), the error is against the median of the real runs, and
   how far the runs lie from their median is printed: the noise floor of the comparison.

Calibration and replays are interleaved: the engine is timed on the grid (one shuffled pass,
`calibrate.calibrate_engine`, a short window) right before every replay, and each round's first replay is
preceded by the worker terms as well (`calibrate.calibrate`); the simulator uses all of them
merged (`calibrate.merge_profiles`: every sample, the median of each overhead term). This machine's
speed moves as a whole between windows of tens of seconds (every grid shape at once; docs/results.md,
2026-11-25 fidelity), so a
profile from one window prices another window's steps off by as much as the target; many short
windows spread over the run average that out, one per replay (the profile still never sees the
replays' shapes). The error with the first calibration alone, taken before any replay, is printed
beside it.

    python benchmarks/fidelity.py [--profile results/profile.json] [--no-reprofile] [--requests 48] [--rate 0.8] [--repeats 1] [--passes 1]

Prints a table; writes results/fidelity.json and results/fidelity.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter
from kvflow.perf import ProfiledPerfModel
from kvflow.perf.calibrate import (GRID_BATCHES, GRID_CONTEXTS, GRID_PROMPTS, calibrate, calibrate_engine, calibrated_profile,
                                   merge_profiles)
from kvflow.simulator import Layout, PipelineGroup, SimConfig, Workload, simulate
from kvflow.simulator.workload import azure_trace, poisson_arrivals

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "benchmarks" / "traces" / "AzureLLMInferenceTrace_conv_first1000.csv"  # its first 1,000 requests
LAYOUTS = ("engine", "colocated-2", "disaggregated-1-1")


def scheduler_config():
    from kvflow.sched.scheduler import SchedulerConfig

    return SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_size=128)


def workload(n: int, rate: float, seed: int) -> Workload:
    """`n` requests of the conversation trace (lengths scaled, see module docstring), Poisson arrivals."""
    t = azure_trace(TRACE, limit=n)
    prompt = np.clip(t.prompt_len // 16, 8, 160)
    out = np.clip(t.output_len // 8, 4, 40)
    return Workload(poisson_arrivals(np.random.default_rng(seed), n, rate), prompt.astype(np.int64), out.astype(np.int64))


# --------------------------------------------------------------------------------------------- real
@dataclass
class Measured:
    arrival: np.ndarray  # when each request was submitted: its Poisson time, plus the client loop's lateness
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray


def backend_for(layout: str):
    from kvflow.config import ClusterConfig, EngineConfig

    eng = EngineConfig(scheduler=scheduler_config(), num_threads=1, num_kv_blocks=1024, block_size=16)
    if layout == "engine":
        from kvflow.serving.backend import EngineBackend

        return EngineBackend.from_config(eng, "smollm2"), None
    from kvflow.controller.controller import Controller

    if layout == "colocated-2":
        cluster = ClusterConfig(engine=eng, mode="colocated", depth=2, microbatch_size=8)
    else:
        cluster = ClusterConfig(engine=eng, mode="disaggregated", prompt_depth=1, token_depth=1, microbatch_size=8,
                                prompt_microbatch_size=8)
    return Controller(cluster), cluster


async def replay(backend, w: Workload, vocab: int, seed: int) -> Measured:
    from kvflow.sched.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(10, vocab - 10, int(s))] for s in w.prompt_len]
    n = w.n
    sent, first, finish = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)

    async def one(i: int, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + w.arrival[i] - time.perf_counter()))
        sent[i] = time.perf_counter() - t0  # times count from the request's submission, as a benchmark client's do
        params = SamplingParams(max_tokens=int(w.output_len[i]), temperature=0.0, ignore_eos=True)
        async for out in backend.generate(prompts[i], params, f"req-{i}"):
            if out.new_token_ids and np.isnan(first[i]):
                first[i] = time.perf_counter() - t0
            if out.finished:
                finish[i] = time.perf_counter() - t0
                assert len(out.token_ids) == w.output_len[i]

    # warm-up (not timed): one short request
    async for _ in backend.generate([11, 12, 13, 14], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "warm"):
        pass
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, t0) for i in range(n)])
    return Measured(sent, first, finish, w.output_len.copy())


def run_real(layout: str, w: Workload, seed: int):
    async def main():
        backend, cluster = backend_for(layout)
        await backend.start()
        try:
            vocab = backend.vocab_size if hasattr(backend, "vocab_size") else backend.engine.model.cfg.vocab_size
            return await replay(backend, w, vocab, seed), cluster, backend
        finally:
            await backend.shutdown()

    return asyncio.run(main())


# ---------------------------------------------------------------------------------------- simulated
def sim_config(layout: str, cluster, backend) -> SimConfig:
    from kvflow.config import EngineConfig

    if layout == "engine":
        eng = backend.engine
        sched = eng.config.scheduler
        return SimConfig(Layout(PipelineGroup(1, sched.max_num_seqs)), policy=sched.policy, scheduler=sched,
                         kv_blocks=eng.kv_manager.num_blocks, block_size=eng.config.block_size,
                         max_model_len=eng.max_model_len)
    assert isinstance(cluster.engine, EngineConfig)
    # Every worker process of the replayed cluster runs on this host: steps beside a busy one are slower.
    return SimConfig.from_cluster(cluster, max_model_len=backend.max_model_len, shared_host=True)


# ------------------------------------------------------------------------------------------ metrics
def metrics(arrival, first, finish, out_len) -> dict:
    span = float(np.max(finish) - np.min(arrival))
    tpot = (finish - first) / np.maximum(out_len - 1, 1)
    return {"throughput_tok_s": float(out_len.sum()) / span, "ttft_p50_s": float(np.median(first - arrival)),
            "tpot_p50_s": float(np.median(tpot[out_len > 1])), "makespan_s": span}


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, default=ROOT / "results" / "profile.json",
                    help="profile to use; written by `kvflow profile` on the calibration grid if missing")
    ap.add_argument("--reprofile", action=argparse.BooleanOptionalAction, default=True,
                    help="calibrate afresh, the engine before every replay and the worker terms once per round "
                         "(default): this machine's speed moves by 15-20%% between windows of ~30 s, so a profile "
                         "from an earlier run prices every step off by that much; --no-reprofile reuses the file")
    ap.add_argument("--requests", type=int, default=48, help="requests per replay (the trace sample's first, at most 1000)")
    ap.add_argument("--rate", type=float, default=0.8, help="Poisson requests/s")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the trace sample")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated worker layouts replayed")
    ap.add_argument("--repeats", type=int, default=1,
                    help="replays per layout (interleaved); the error is against their median, their spread is printed")
    ap.add_argument("--passes", type=int, default=1, help="passes over the grid in each engine calibration window")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    w = workload(args.requests, args.rate, args.seed)
    print(f"workload: {w.n} requests, Poisson {args.rate}/s, prompts {int(w.prompt_len.min())}-{int(w.prompt_len.max())} "
          f"(median {int(np.median(w.prompt_len))}), outputs {int(w.output_len.min())}-{int(w.output_len.max())} "
          f"(median {int(np.median(w.output_len))})")
    layouts = args.layouts.split(",")
    runs: dict[str, list] = {layout: [] for layout in layouts}
    calibrations, windows = [], []  # full calibrations (one per round); engine-only windows (before the other replays)
    if not args.reprofile:
        calibrations.append(calibrated_profile(args.profile))
    for r in range(args.repeats):  # interleaved: before every replay a calibration window (when calibrating afresh)
        for i, layout in enumerate(layouts):
            if args.reprofile and i == 0:
                print(f"calibration {r + 1}/{args.repeats}: the engine on the grid's own shapes, the worker terms ...", flush=True)
                calibrations.append(calibrate(passes=args.passes))
            elif args.reprofile:
                windows.append(calibrate_engine(passes=args.passes))
            t0 = time.perf_counter()
            measured, cluster, backend = run_real(layout, w, args.seed)
            wall = time.perf_counter() - t0
            real = metrics(measured.arrival, measured.first_token, measured.finish, measured.output_len)
            # the simulator's twin of this configuration, taken now: the run list holds no engine
            runs[layout].append((real, measured, sim_config(layout, cluster, backend), wall))
            del backend
            print(f"  {layout:<18} replay {r + 1}/{args.repeats} in {wall:5.0f} s: real {real['throughput_tok_s']:.2f} tok/s, "
                  f"ttft {real['ttft_p50_s']:.2f} s, tpot {real['tpot_p50_s'] * 1e3:.0f} ms", flush=True)
    # The machine's speed moves as a whole between windows; the merged profile averages the
    # windows taken right before every replay (never their shapes).
    profile = merge_profiles(calibrations, windows)
    if args.reprofile:
        profile.save(args.profile)
    perf = ProfiledPerfModel(profile)
    perf_workers = ProfiledPerfModel(profile, executor=True)
    print(f"profile ({len(calibrations)} calibration(s), {len(calibrations) + len(windows)} engine windows): prompt fit {perf.prompt_fit.coef} (max rel. error "
          f"{perf.prompt_fit.max_rel_error:.0%}), token fit {perf.token_fit.coef} (max rel. error "
          f"{perf.token_fit.max_rel_error:.0%}), worker overhead per pass {profile.pass_overhead_s * 1e3:.1f} ms + "
          f"{profile.seq_overhead_s * 1e3:.2f} ms per sequence, per further stage {profile.hop_overhead_s * 1e3:.1f} ms, "
          f"per prompt pass {profile.prompt_overhead_s * 1e3:.1f} ms more, engine host-side work per step "
          f"{profile.engine_host_s * 1e3:.1f} ms (not paid by workers), beside a busy worker prefill "
          f"x{profile.co_run[0]:.2f} decode x{profile.co_run[1]:.2f}")
    first_only = (ProfiledPerfModel(calibrations[0]), ProfiledPerfModel(calibrations[0], executor=True)) \
        if len(calibrations) > 1 else None
    rows = {}
    keys = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s")
    for layout in layouts:
        reals = [x[0] for x in runs[layout]]
        real = {k: float(np.median([x[k] for x in reals])) for k in reals[0]}
        _, measured, cfg, wall = runs[layout][-1]
        res = simulate(cfg, perf if layout == "engine" else perf_workers, w)
        sim = metrics(res.arrival, res.first_token, res.finish, res.output_len)
        err = {k: sim[k] / real[k] - 1 for k in keys}
        # how far the real runs are from their own median: the noise floor of the comparison
        spread = {k: max(abs(x[k] / real[k] - 1) for x in reals) for k in keys}
        rows[layout] = {"real": real, "real_runs": reals, "real_spread": spread, "sim": sim, "error": err, "wall_s": wall,
                        "real_ttft": (measured.first_token - measured.arrival).tolist(), "sim_ttft": res.ttft.tolist()}
        if cfg.shared_host:  # the same simulation with a machine per worker (no contention model), for comparison
            alone = simulate(dataclasses.replace(cfg, shared_host=False), perf_workers, w)
            a = metrics(alone.arrival, alone.first_token, alone.finish, alone.output_len)
            rows[layout]["error_machine_per_worker"] = {k: a[k] / real[k] - 1 for k in err}
        if first_only is not None:  # the first calibration alone, taken before any replay, for comparison
            one = simulate(cfg, first_only[0] if layout == "engine" else first_only[1], w)
            o = metrics(one.arrival, one.first_token, one.finish, one.output_len)
            rows[layout]["error_first_calibration"] = {k: o[k] / real[k] - 1 for k in err}
    print(f"\n{'layout':<18} | {'throughput tok/s':^24} | {'median TTFT s':^24} | {'median TPOT ms':^24}")
    print(f"{'':<18} | {'real':>6} {'sim':>6} {'err':>8} | {'real':>6} {'sim':>6} {'err':>8} | {'real':>6} {'sim':>6} {'err':>8}")
    for layout, r in rows.items():
        cells = []
        for k, scale in (("throughput_tok_s", 1), ("ttft_p50_s", 1), ("tpot_p50_s", 1e3)):
            cells.append(f"{r['real'][k] * scale:6.2f} {r['sim'][k] * scale:6.2f} {r['error'][k]:+8.1%}")
        print(f"{layout:<18} | " + " | ".join(cells))
    for layout, r in rows.items():
        if "error_machine_per_worker" in r:
            e = r["error_machine_per_worker"]
            print(f"{layout:<18}   without the shared-host model: throughput {e['throughput_tok_s']:+.1%}, "
                  f"TTFT {e['ttft_p50_s']:+.1%}, TPOT {e['tpot_p50_s']:+.1%}")
    for layout, r in rows.items():
        if "error_first_calibration" in r:
            e = r["error_first_calibration"]
            print(f"{layout:<18}   with the first calibration alone: throughput {e['throughput_tok_s']:+.1%}, "
                  f"TTFT {e['ttft_p50_s']:+.1%}, TPOT {e['tpot_p50_s']:+.1%}")
    if args.repeats > 1:
        for layout, r in rows.items():
            sp = r["real_spread"]
            print(f"{layout:<18}   real runs within {sp['throughput_tok_s']:.1%} / {sp['ttft_p50_s']:.1%} / "
                  f"{sp['tpot_p50_s']:.1%} of their median (throughput / TTFT / TPOT, {args.repeats} replays)")
    worst = max(abs(e) for r in rows.values() for e in r["error"].values())
    print(f"worst |error| {worst:.1%} (target < 10%); total {time.perf_counter() - t_start:.0f} s")
    doc = {"profile": str(args.profile), "calibrations": len(calibrations), "engine_windows": len(calibrations) + len(windows),
           "passes": args.passes, "profile_grid": {"batches": GRID_BATCHES, "prompts": GRID_PROMPTS,
                                                          "contexts": GRID_CONTEXTS},
           "workload": {"requests": w.n, "rate": args.rate, "seed": args.seed, "trace": TRACE.name, "repeats": args.repeats,
                        "scaling": "prompt // 16 clipped [8, 160]; output // 8 clipped [4, 40]"},
           "layouts": rows, "worst_abs_error": worst}
    write_results(ROOT / "results" / "fidelity", doc, lambda plt: figure(plt, rows))


def figure(plt, rows: dict):
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    keys = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s")
    x = np.arange(len(keys))
    for i, (layout, r) in enumerate(rows.items()):
        axes[0].bar(x + i * 0.25, [100 * r["error"][k] for k in keys], 0.25, label=layout)
        axes[1].plot(sorted(r["real_ttft"]), np.linspace(0, 1, len(r["real_ttft"])), label=f"{layout} real")
        axes[1].plot(sorted(r["sim_ttft"]), np.linspace(0, 1, len(r["sim_ttft"])), "--", label=f"{layout} sim")
    axes[0].axhspan(-10, 10, color="green", alpha=0.1)
    axes[0].set(xticks=x + 0.25, xticklabels=["throughput", "median TTFT", "median TPOT"], ylabel="sim / real - 1 (%)",
                title="simulator error (target band ±10%)")
    axes[0].legend(fontsize=8)
    axes[1].set(xlabel="TTFT (s)", ylabel="CDF", title="TTFT: real vs simulated")
    axes[1].legend(fontsize=7)
    return fig

if __name__ == "__main__":
    main()

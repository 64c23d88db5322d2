"""Fault tolerance on real worker processes: DéjàVu Fig. 10, Fig. 11 and the replication overhead.

Two clusters of the same layout (default: colocated depth 2, the embedded SmolLM2-135M), one with
ring replication (`resume`: a replaced stage gets its KV back from the replica and requests resume
from the replication watermark) and one without (`recompute`: the requests of the lost pipeline are
recomputed from prompt + produced tokens, our counterpart of DéjàVu's restart), run side by side,
interleaved round by round:

  overhead   the same batch with no failure on both clusters: replication's cost in throughput
             (target <= 1% here; DéjàVu reports <= 2%)
  Fig. 10    the same batch with a SIGKILL of one stage once half of its tokens are out (an event):
             latency of the batch relative to the failure-free run of the same cluster
  Fig. 11    a longer stream of requests with failures at fixed times: completed requests over time,
             and the simulator's prediction of it (same arrivals, cluster settings and kill times,
             profiled step times, each policy's measured recovery costs)

Replacement start-up (a new process loading its layers) is part of every recovery and is reported.

    python benchmarks/fault_tolerance.py [--model PATH] [--batch 8 --prompt 64 --new 64 --rounds 3]

Writes results/fault_tolerance.json and results/fault_tolerance.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

RESULTS = Path(__file__).resolve().parents[1] / "results"
POLICIES = {"resume": "ring", "recompute": "none"}


def cluster_config(replication: str, args):
    from kvflow.config import ClusterConfig, EngineConfig

    engine = EngineConfig(model=args.model, dtype=args.dtype, block_size=16, num_kv_blocks=2048, max_model_len=1024)
    return ClusterConfig(engine=engine, mode="colocated", depth=args.depth, microbatch_size=args.batch,
                         threads_per_worker=1, heartbeat_timeout_s=60.0, replication=replication)


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, 49152) for _ in range(length)] for _ in range(n)]


async def batch(ctrl, tag: str, ps, new: int, kill: str | None = None, kill_after: int = 0) -> dict:
    """All prompts at once; with `kill`, SIGKILL that stage once `kill_after` tokens are out."""
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    count, hit = 0, asyncio.Event()
    tokens = [[] for _ in ps]

    async def one(i, p):
        nonlocal count
        async for out in ctrl.generate(p, params, f"{tag}-{i}"):
            tokens[i] += out.new_token_ids
            count += len(out.new_token_ids)
            if count >= kill_after:
                hit.set()
            if out.finished and out.finish_reason != "length":
                raise RuntimeError(f"{tag}: request {i} ended with {out.finish_reason}: {out.error}")

    n_rec = len(ctrl.recovery.log)
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(ps)]
    killed_at = None
    if kill is not None:
        await hit.wait()
        killed_at = time.monotonic()
        os.kill(ctrl.stages[kill].process.pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "tokens": tokens, "out_tok_s": sum(map(len, tokens)) / wall}
    if kill is not None:
        while len(ctrl.recovery.log) == n_rec:
            await asyncio.sleep(0.01)
        res["costs"] = costs_of(ctrl.recovery.log[n_rec], killed_at)
        res["recovery_s"] = res["costs"]["total_s"]
    return res


def costs_of(rec, killed_at: float) -> dict:
    """One recovery's measured costs (s): kill -> detected, replacement start-up, KV restore."""
    return {"detect_s": rec.detected_at - killed_at, "replace_s": rec.replace_s, "restore_s": rec.restore_s,
            "total_s": rec.detected_at - killed_at + rec.total_s, "resumed": rec.resumed}


async def stream(ctrl, tag: str, rng: random.Random, args, kill_at: list[float], victim: str) -> dict:
    """Fig. 11: requests arriving at `args.rate`/s for `args.duration` s; SIGKILL `victim` at the
    times in `kill_at`. Returns arrivals, completion times and kill times (s from the start) and
    the measured cost of each recovery."""
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    done: list[float] = []
    kills: list[tuple[float, float]] = []  # (s from the start, time.monotonic())
    n_rec = len(ctrl.recovery.log)
    t0 = time.perf_counter()

    async def one(i, p):
        async for out in ctrl.generate(p, params, f"{tag}-{i}"):
            if out.finished:
                done.append(time.perf_counter() - t0)

    async def killer():
        for t in kill_at:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))
            kills.append((time.perf_counter() - t0, time.monotonic()))
            os.kill(ctrl.stages[victim].process.pid, signal.SIGKILL)
        while len(ctrl.recovery.log) < n_rec + len(kill_at):
            await asyncio.sleep(0.01)

    tasks, k = [], asyncio.ensure_future(killer())
    n = int(args.rate * args.duration)
    arrivals = sorted(rng.uniform(0, args.duration) for _ in range(n))
    for i, (at, p) in enumerate(zip(arrivals, prompts(rng, n, args.prompt))):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        tasks.append(asyncio.ensure_future(one(i, p)))
    await asyncio.gather(*tasks, k)
    costs = [costs_of(r, m) for r, (_, m) in zip(ctrl.recovery.log[n_rec:], kills)]
    return {"arrivals": arrivals, "done": sorted(done), "kill_at": [t for t, _ in kills], "costs": costs}


async def run(args) -> dict:
    from kvflow.controller.controller import Controller

    rng = random.Random(0)
    ctrls = {}
    victim = f"colocated-{args.depth - 1}"
    res: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "overhead": {k: [] for k in POLICIES}, "fig10": {k: [] for k in POLICIES},
                 "fig11": {}}
    try:
        for name, rep in POLICIES.items():
            print(f"starting the {name!r} cluster (replication {rep}) ...", flush=True)
            ctrls[name] = Controller(cluster_config(rep, args))
            await ctrls[name].start()
        half = args.batch * args.new // 2
        for r in range(-1, args.rounds):  # round -1 warms up
            ps = prompts(rng, args.batch, args.prompt)
            order = list(POLICIES)
            rng.shuffle(order)
            ref = {}
            for name in order:
                ref[name] = await batch(ctrls[name], f"{name}-ok-{r}", ps, args.new)
            for name in order:
                hit = await batch(ctrls[name], f"{name}-kill-{r}", ps, args.new, victim, half)
                if r >= 0:
                    res["overhead"][name].append(ref[name]["out_tok_s"])
                    res["fig10"][name].append({"ratio": hit["wall_s"] / ref[name]["wall_s"], "wall_s": hit["wall_s"],
                                               "same_tokens": hit["tokens"] == ref[name]["tokens"],
                                               "ref_wall_s": ref[name]["wall_s"], "recovery_s": hit["recovery_s"],
                                               "costs": hit["costs"]})
            if r >= 0:
                print(f"round {r + 1}/{args.rounds}: " + "  ".join(
                    f"{n}: {res['overhead'][n][-1]:.1f} tok/s, failure x{res['fig10'][n][-1]['ratio']:.2f} "
                    f"(recovery {res['fig10'][n][-1]['recovery_s']:.2f}s)" for n in POLICIES), flush=True)
        kill_at = [args.duration * f for f in (0.3, 0.6)]
        for name in POLICIES:
            print(f"Fig. 11 stream on {name} ...", flush=True)
            res["fig11"][name] = await stream(ctrls[name], f"{name}-stream", random.Random(1), args, kill_at, victim)
        res["fig11"]["no failure"] = await stream(ctrls["resume"], "free-stream", random.Random(1), args, [], victim)
        res["resumed"] = ctrls["resume"].resumed
        res["replicated_bytes"] = sum(s.replica_bytes_sent for s in ctrls["resume"].stages.values())
    finally:
        for c in ctrls.values():
            await c.shutdown()
    return res


def main() -> None:
    from kvflow.model.loader import default_model_path

    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--depth", type=int, default=2, help="colocated pipeline depth (the last stage is killed)")
    ap.add_argument("--batch", type=int, default=8, help="requests per batch (and microbatch size)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (medians)")
    ap.add_argument("--rate", type=float, default=2.0,
                    help="Fig. 11 arrivals per second (default: above what the cluster serves, so it is never idle)")
    ap.add_argument("--duration", type=float, default=30.0, help="Fig. 11 seconds of arrivals")
    ap.add_argument("--profile", type=Path, default=RESULTS / "profile.json",
                    help="step-time profile for the simulated Fig. 11 (made by the calibration of "
                         "benchmarks/fidelity.py if missing)")
    args = ap.parse_args()
    args.model = args.model or str(default_model_path())
    res = asyncio.run(run(args))

    ov = {n: statistics.median(v) for n, v in res["overhead"].items()}
    per_round = [a / b for a, b in zip(res["overhead"]["resume"], res["overhead"]["recompute"])]
    res["overhead_pct"] = (1 - statistics.median(per_round)) * 100
    print(f"\ncolocated depth {args.depth}, {args.batch} x ({args.prompt} in, {args.new} out), {args.rounds} rounds, {args.dtype}")
    print(f"{'policy':<11}{'tok/s p50 (no failure)':>24}{'failure latency x p50':>23}{'recovery p50 (s)':>18}")
    for n in POLICIES:
        f = res["fig10"][n]
        print(f"{n:<11}{ov[n]:>24.1f}{statistics.median(x['ratio'] for x in f):>23.2f}"
              f"{statistics.median(x['recovery_s'] for x in f):>18.2f}")
    same = [x["same_tokens"] for n in POLICIES for x in res["fig10"][n]]
    print(f"runs with a failure whose tokens equal the failure-free run's: {sum(same)}/{len(same)}")
    print(f"replication overhead (throughput, median of per-round ratios): {res['overhead_pct']:.1f}%  "
          f"(DéjàVu Fig. 10: restart 1.91x, resume 1.24x)")
    for n, d in res["fig11"].items():
        print(f"Fig. 11 {n:<11}: {len(d['done'])} requests done, last at {d['done'][-1]:.1f}s" if d["done"] else n)
    res["recovery_costs"] = {n: measured_costs(res, n) for n in POLICIES}
    print(f"\n{'measured recovery (s, p50)':<28}{'detect':>8}{'replace':>9}{'restore':>9}{'total':>8}")
    for n, c in res["recovery_costs"].items():
        print(f"{n:<28}{c['detect_s']:>8.2f}{c['replace_s']:>9.2f}{c['restore_s']:>9.2f}{c['total_s']:>8.2f}")
    res["fig11_sim"] = predict_fig11(res, args)
    print(f"\nFig. 11, all {len(res['fig11']['no failure']['arrivals'])} requests done at (s): real vs simulated "
          f"with the measured recovery costs ({args.profile})")
    for n, d in res["fig11"].items():
        real, sim = d["done"][-1], res["fig11_sim"][n][-1]
        print(f"  {n:<11} real {real:6.1f}   sim {sim:6.1f}   error {sim / real - 1:+6.1%}")
    ratio = {k: res[k]["recompute"][-1] / res[k]["resume"][-1] if k == "fig11_sim" else
             res[k]["recompute"]["done"][-1] / res[k]["resume"]["done"][-1] for k in ("fig11", "fig11_sim")}
    print(f"  recompute / resume completion time: real {ratio['fig11']:.2f}x, sim {ratio['fig11_sim']:.2f}x "
          f"(DéjàVu Fig. 11: 1.16x)")
    res["fig11_ratio"] = ratio
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_tolerance.json").write_text(json.dumps(res, indent=2))
    plot(res, RESULTS / "fault_tolerance.png")
    print(f"wrote {RESULTS / 'fault_tolerance.json'} and fault_tolerance.png")


def measured_costs(res: dict, name: str) -> dict:
    """Median cost of each recovery step over every recovery of the `name` cluster (Fig. 10 and 11)."""
    rows = [x["costs"] for x in res["fig10"][name]] + res["fig11"][name]["costs"]
    return {k: statistics.median(r[k] for r in rows) for k in ("detect_s", "replace_s", "restore_s", "total_s")}


def predict_fig11(res: dict, args) -> dict:
    """The simulator's Fig. 11: the same arrivals, lengths, cluster settings (`SimConfig.from_cluster`)
    and kill times, the profiled step times (`kvflow profile` + the worker overhead per stage) and
    each policy's measured recovery costs (`Recovery.measured`). Returns sorted completion times."""
    import numpy as np

    from kvflow.perf import ProfiledPerfModel
    from kvflow.perf.calibrate import calibrated_profile
    from kvflow.simulator import Failure, Recovery, SimConfig, Workload, simulate

    perf = ProfiledPerfModel(calibrated_profile(args.profile, args.model), executor=True)
    out = {}
    for name, d in res["fig11"].items():
        n = len(d["arrivals"])
        w = Workload(np.array(d["arrivals"]), np.full(n, args.prompt, dtype=np.int64), np.full(n, args.new, dtype=np.int64))
        failures = tuple(Failure(t, "prompt", 0, args.depth - 1) for t in d["kill_at"])
        rec = Recovery.measured("resume" if name == "resume" else "restart", res["recovery_costs"][name]) \
            if failures else Recovery()
        cfg = SimConfig.from_cluster(cluster_config(POLICIES.get(name, "ring"), args), max_model_len=1024,
                                     failures=failures, recovery=rec)
        out[name] = sorted(simulate(cfg, perf, w).finish.tolist())
    return out


def plot(res: dict, path: Path) -> None:
    from kvflow.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    names = list(POLICIES)
    ax[0].bar(names, [statistics.median(x["ratio"] for x in res["fig10"][n]) for n in names], color=["#4a4", "#c44"])
    ax[0].axhline(1, color="k", lw=1)
    ax[0].set_ylabel("batch latency with a failure / without")
    ax[0].set_title("Fig. 10: a failure mid-generation")
    for (n, d), c in zip(res["fig11"].items(), ("#4a4", "#c44", "#44c")):
        ax[1].step(d["done"], range(1, len(d["done"]) + 1), where="post", label=f"{n} (real)", color=c)
        sim = res.get("fig11_sim", {}).get(n)
        if sim:
            ax[1].step(sim, range(1, len(sim) + 1), where="post", label=f"{n} (simulated)", color=c, ls="--", lw=1)
    for t in res["fig11"]["resume"]["kill_at"]:
        ax[1].axvline(t, color="#888", ls=":", lw=1)
    ax[1].set_xlabel("time (s)")
    ax[1].set_ylabel("completed requests")
    ax[1].set_title("Fig. 11: failures at fixed times")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

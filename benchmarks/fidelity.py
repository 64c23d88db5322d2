"""Fidelity: predict real engine batch runs with the simulator + profiled PerfModel.

Loads a profile written by `kvflow profile` (default results/profile.json), runs the real
single-process engine on a few offline batches (B requests of S prompt tokens, G output tokens
each, all submitted at once), and simulates the same workload as a depth-1 colocated pipeline
with microbatch B. Reports the throughput and median normalized-latency prediction errors.
    python benchmarks/fidelity.py [--profile results/profile.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvflow.perf import ProfiledPerfModel
from kvflow.simulator import Layout, PipelineSpec, SimConfig, Workload, simulate

CASES = [(4, 64, 32), (8, 128, 24), (2, 256, 48), (8, 32, 64)]  # (batch, prompt, output)


def run_engine(engine, b: int, s: int, g: int, rng) -> tuple[float, np.ndarray]:
    """Wall seconds of the whole batch and each request's end-to-end latency."""
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=g, ignore_eos=True, temperature=0.0)
    vocab = engine.model.cfg.vocab_size
    t0 = time.perf_counter()
    ids = [engine.add_request([int(x) for x in rng.integers(10, vocab - 10, s)], params).request_id
           for _ in range(b)]
    done: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter() - t0
    return time.perf_counter() - t0, np.array([done[i] for i in ids])


def main() -> None:
    import torch

    from kvflow.perf.calibrate import _engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=Path("results/profile.json"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    perf = ProfiledPerfModel.from_json(args.profile)
    engine = _engine(None, 8, 8 * 256, args.threads)
    rng = np.random.default_rng(1)
    run_engine(engine, 2, 16, 4, rng)  # warm-up
    rows = []
    print(f"{'B':>3} {'S':>5} {'G':>4} | {'real tok/s':>10} {'sim tok/s':>10} {'err':>7} | "
          f"{'real nlat':>9} {'sim nlat':>9} {'err':>7}")
    for b, s, g in CASES:
        wall, lat = run_engine(engine, b, s, g, rng)
        w = Workload(np.zeros(b), np.full(b, s, dtype=np.int64), np.full(b, g, dtype=np.int64))
        res = simulate(SimConfig(Layout(PipelineSpec(1, b))), perf, w)
        real_tp, sim_tp = b * g / wall, b * g / res.makespan
        real_nl, sim_nl = float(np.median(lat / g)), float(np.median(res.normalized_latency))
        row = {"batch": b, "prompt": s, "output": g, "real_tokens_per_s": real_tp, "sim_tokens_per_s": sim_tp,
               "throughput_error": sim_tp / real_tp - 1, "real_norm_latency": real_nl, "sim_norm_latency": sim_nl,
               "norm_latency_error": sim_nl / real_nl - 1}
        rows.append(row)
        print(f"{b:>3} {s:>5} {g:>4} | {real_tp:10.1f} {sim_tp:10.1f} {row['throughput_error']:+7.1%} | "
              f"{real_nl:9.4f} {sim_nl:9.4f} {row['norm_latency_error']:+7.1%}")
    mean_abs = {k: float(np.mean([abs(r[k]) for r in rows])) for k in ("throughput_error", "norm_latency_error")}
    print(f"mean |error|: throughput {mean_abs['throughput_error']:.1%}, "
          f"median normalized latency {mean_abs['norm_latency_error']:.1%}")
    Path("results").mkdir(exist_ok=True)
    Path("results/fidelity.json").write_text(json.dumps({"rows": rows, "mean_abs": mean_abs}, indent=1))


if __name__ == "__main__":
    main()

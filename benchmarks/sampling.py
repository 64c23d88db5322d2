"""The sampler's time per engine step: the batched sampler against an earlier revision's, interleaved in one process.

    python benchmarks/sampling.py [--baseline 62f60f5] [--batches 1 16 64] [--repeats 3] [--threads 2] [--clock wall]

The baseline is the sampler as it was at `--baseline` (`kvflow/sched/sampler.py`, or `sampling.py` before
the sampler had its own module; read with `git show`, loaded as a
module of its own: the code that ran then, not a copy kept in the tree; default: the per-request
sampler). Both sample the same `Request` objects from the same logits [batch, V] (V: SmolLM2's
vocabulary, 49,152; random logits of the spread a model's have), through `sample_requests`, the one
entry point the engine's runner and the controller call. Cases: temperature 1 (what vLLM's benchmark
client sends: no temperature, no filters, no seed), temperature 0.7 with top-k 50 and top-p 0.9,
temperature 1 seeded per request, and greedy. Each repeat times every case on both samplers, the
order alternating; prints median ms per step and new / old; writes results/sampling.json and .png.
`--clock cpu` times by the process's CPU time (all its threads), which other jobs on a shared machine
cannot stretch by taking its cores away; wall time is what a step waits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
VOCAB = 49_152


def load_baseline(rev: str):
    """The sampler's module at git revision `rev` (`sampler.py`, else `sampling.py`), as a module."""
    show = lambda name: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kvflow/sched/{name}"],  # noqa: E731
                                       capture_output=True, text=True)
    got = show("sampler.py")
    if got.returncode != 0:
        got = show("sampling.py")
        got.check_returncode()
    src = got.stdout
    path = Path(tempfile.mkdtemp()) / "sampling_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def cases():
    from kvflow.sched.sampling import SamplingParams

    return {
        "t1": lambda i: SamplingParams(temperature=1.0, max_tokens=128),
        "t0.7 k50 p0.9": lambda i: SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=128),
        "t1 seeded": lambda i: SamplingParams(temperature=1.0, seed=i, max_tokens=128),
        "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=128),
    }


def time_steps(fn, logits: torch.Tensor, reqs, steps: int, clock) -> float:
    """Median seconds of one `fn(logits, reqs)` over `steps` calls (after one untimed call)."""
    fn(logits, reqs)
    times = []
    for _ in range(steps):
        t0 = clock()
        fn(logits, reqs)
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--baseline", default="62f60f5", help="git revision whose sampler is the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="rows sampled per step")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every case, the order alternating")
    ap.add_argument("--steps", type=int, default=3, help="timed calls per case and round (their median counts)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the engine's thread uses all cores)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall: perf_counter; cpu: process_time")
    args = ap.parse_args()

    from kvflow.sched import sampler
    from kvflow.sched.request import Request

    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    old = load_baseline(args.baseline)
    samplers = {"old": old.sample_requests, "new": sampler.sample_requests}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for b in args.batches:
            logits = torch.randn(b, VOCAB, generator=g) * 2.5
            for case, make in cases().items():
                order = list(samplers) if rep % 2 == 0 else list(reversed(samplers))
                for name in order:
                    reqs = [Request(f"r{i}", [1, 2, 3], make(i)) for i in range(b)]
                    for r in reqs:
                        r.output_token_ids.extend(range(100, 164))
                    times.setdefault(f"{case}|{b}|{name}", []).append(time_steps(samplers[name], logits, reqs, args.steps, clock))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    rows = []
    print(f"\nms per step ({args.clock} clock, median of {args.repeats} rounds x {args.steps} calls), {args.threads} threads, "
          f"V={VOCAB}, baseline {args.baseline}; {platform.processor() or platform.machine()}")
    print(f"{'case':<15} {'batch':>5} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for case in cases():
        for b in args.batches:
            o, n = (statistics.median(times[f"{case}|{b}|{k}"]) for k in ("old", "new"))
            rows.append({"case": case, "batch": b, "old_ms": o * 1e3, "new_ms": n * 1e3, "ratio": n / o})
            print(f"{case:<15} {b:>5} {o * 1e3:>9.2f} {n * 1e3:>9.2f} {n / o:>8.3f}")
    RESULTS.mkdir(exist_ok=True)
    doc = {"config": vars(args), "vocab": VOCAB, "rows": rows, "times_s": times}
    (RESULTS / "sampling.json").write_text(json.dumps(doc, indent=1))
    plot(rows, args.batches, RESULTS / "sampling.png")
    print(f"wrote {RESULTS / 'sampling.json'} and .png")


def plot(rows: list[dict], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for a, case in zip(ax[0], names):
        sel = [r for r in rows if r["case"] == case]
        x = range(len(sel))
        a.bar([i - 0.2 for i in x], [r["old_ms"] for r in sel], 0.4, label="old")
        a.bar([i + 0.2 for i in x], [r["new_ms"] for r in sel], 0.4, label="new")
        a.set_xticks(list(x), [f"b={r['batch']}" for r in sel])
        a.set_yscale("log")
        a.set_title(case)
        a.set_ylabel("ms per step")
    ax[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

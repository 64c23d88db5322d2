"""Microbatch swapping (DéjàVu §4.2.2, Figure 9) on the server's own path: real worker processes.

One colocated pipeline of `--depth` stages (microbatch policy, `depth` microbatches in flight) and
one device KV budget per stage (`--device-blocks` blocks of 16 tokens). Each request holds
prompt + max_tokens tokens of KV for its whole life (the microbatch policy reserves it at
admission), so:

  no swapping   every in-flight microbatch keeps its KV on the device: the largest microbatch that
                fits is B = device_blocks / (depth x blocks per request)
  swapping      only the microbatch computing on a stage and the next one keep theirs there
                (min(2, depth) regions of device_blocks / 2), the others' lives in host memory:
                microbatches of 2B at depth 4 (twice the requests in flight)

Both clusters are started together and run the same `--requests` requests (random prompt token ids,
`--max-tokens` greedy tokens, ignore_eos), rounds alternating which goes first. Reported per variant:
output tokens/s (median over rounds) and their ratio (paper: up to 1.8x), and, from the swapping
workers' own counters, the seconds spent swapping in (background thread), the seconds the compute
thread waited for it, the fraction hidden behind compute (1 - wait / swap-in), and the measured
host -> device bandwidth, which is what the simulator's swap model (`PerfModel.swap_in_time`, per
device host link) takes: the JSON gives the simulator's swap-in time per step at that bandwidth.

On a CPU the "device" is host memory too: a swap-in is a memory copy run by a second thread that
competes with the compute threads for the same cores (2 here), so little of it can be hidden and
the bigger batches buy less than on a GPU, where the copy runs on the DMA engines.

    python benchmarks/swapping.py [--depth 4 --device-blocks 48 --prompt 64 --max-tokens 32 --requests 32 --rounds 3]

Writes results/swapping.json and results/swapping.png.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = ("no swapping", "swapping")


def blocks_per_request(args) -> int:
    return -(-(args.prompt + args.max_tokens) // 16)


def cluster_config(variant: str, args):
    from kvflow.config import ClusterConfig, EngineConfig

    bpr = blocks_per_request(args)
    b = args.device_blocks // (args.depth * bpr)
    if b < 1:
        raise SystemExit(f"{args.device_blocks} device blocks cannot hold {args.depth} microbatches of one request "
                         f"({bpr} blocks each)")
    swapping = variant == "swapping"
    mb = args.device_blocks // (min(2, args.depth) * bpr) if swapping else b
    engine = EngineConfig(model=args.model, dtype=args.dtype, block_size=16, num_kv_blocks=args.device_blocks,
                          max_model_len=args.prompt + args.max_tokens + 16, enable_prefix_caching=False)
    return ClusterConfig(engine=engine, mode="colocated", depth=args.depth, policy="microbatch", microbatch_size=mb,
                         threads_per_worker=args.threads, heartbeat_timeout_s=120.0, swapping=swapping,
                         replication="none"), mb


async def one_round(ctrl, args, prompts, tag: str) -> dict:
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    before = {s.name: dict(s.swap) for s in ctrl.stages.values()}

    async def one(i: int) -> list[int]:
        toks = []
        async for out in ctrl.generate(prompts[i], params, f"{tag}-{i}"):
            toks += out.new_token_ids
        return toks

    t0 = time.monotonic()
    toks = await asyncio.gather(*[one(i) for i in range(len(prompts))])
    makespan = time.monotonic() - t0
    await asyncio.sleep(1.0)  # the workers' counters arrive with their heartbeats
    swap = {}
    for s in ctrl.stages.values():
        now, was = s.swap, before[s.name]
        swap[s.name] = {k: now.get(k, 0) - was.get(k, 0) for k in now}
    return {"makespan_s": makespan, "output_tok_per_s": sum(map(len, toks)) / makespan, "tokens": toks, "swap": swap}


async def run(args) -> dict:
    from kvflow.controller.controller import Controller

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.prompt).tolist() for _ in range(args.requests)]
    ctrls, mbs = {}, {}
    for v in VARIANTS:
        cfg, mbs[v] = cluster_config(v, args)
        ctrls[v] = Controller(cfg)
    await asyncio.gather(*[c.start() for c in ctrls.values()])
    rounds = []
    try:
        for v in VARIANTS:  # warm-up
            await one_round(ctrls[v], args, prompts[: mbs[v]], f"warm-{v}")
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                res = await one_round(ctrls[v], args, prompts, f"r{r}-{v}")
                res.update(variant=v, round=r)
                rounds.append(res)
                print(f"round {r} {v:<12}: {res['makespan_s']:.1f} s, {res['output_tok_per_s']:.1f} out tok/s", flush=True)
    finally:
        await asyncio.gather(*[c.shutdown() for c in ctrls.values()])
    return {"rounds": rounds, "microbatch": mbs}


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 where the CPU has native bf16)")
    ap.add_argument("--depth", type=int, default=4, help="colocated pipeline depth")
    ap.add_argument("--device-blocks", type=int, default=48, help="each stage's device KV budget, blocks of 16 tokens")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--requests", type=int, default=32, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out", type=Path, default=RESULTS / "swapping", help="output stem (.json, .png)")
    args = ap.parse_args()

    from kvflow.config import EngineConfig
    from kvflow.model.loader import load_config
    from kvflow.perf.hardware import machine
    from kvflow.perf.model_shape import ModelShape
    from kvflow.perf.perf_model import AnalyticPerfModel

    args.dtype = EngineConfig(dtype=args.dtype).dtype
    res = asyncio.run(run(args))
    rounds = res["rounds"]
    same = all(r["tokens"] == rounds[0]["tokens"] for r in rounds)
    med = {v: statistics.median(r["output_tok_per_s"] for r in rounds if r["variant"] == v) for v in VARIANTS}
    ratios = [s["output_tok_per_s"] / n["output_tok_per_s"] for n, s in
              zip([r for r in rounds if r["variant"] == "no swapping"], [r for r in rounds if r["variant"] == "swapping"])]
    sw = [st for r in rounds if r["variant"] == "swapping" for st in r["swap"].values()]
    swap_s = sum(s.get("swap_in_s", 0.0) for s in sw)
    wait_s = sum(s.get("wait_s", 0.0) for s in sw)
    swap_bytes = sum(s.get("swap_in_bytes", 0) for s in sw)
    back_bytes = sum(s.get("write_back_bytes", 0) for s in sw)
    # hidden: the share of the swap-in time the compute thread did not wait for (0 when it waited as
    # long as the copies took or longer: thread hand-offs on oversubscribed cores cost time too)
    hidden = max(0.0, 1 - wait_s / swap_s) if swap_s else float("nan")
    bandwidth = swap_bytes / swap_s if swap_s else float("nan")

    # The simulator's swap model at the measured bandwidth: one microbatch's swap-in per stage and step.
    mc, _ = load_config(args.model)
    spec = dataclasses.replace(machine("1xCPU"), host_bandwidth=bandwidth)
    shape = ModelShape(mc.name, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                       mc.intermediate_size, mc.vocab_size, dtype_bytes=4 if args.dtype == "float32" else 2, gated_mlp=True)
    perf = AnalyticPerfModel(shape, spec)
    ctx = args.prompt + args.max_tokens // 2
    sim_swap = perf.swap_in_time(res["microbatch"]["swapping"], ctx, args.depth)

    mbs = res["microbatch"]
    print(f"\nSmolLM2-135M ({args.dtype}), colocated depth {args.depth}, device budget {args.device_blocks} blocks of 16 tokens "
          f"per stage, {args.requests} requests of {args.prompt} + {args.max_tokens} tokens, {args.threads} thread(s) per worker, "
          f"medians of {args.rounds} rounds")
    print(f"{'variant':<14}{'microbatch':>11}{'in flight':>10}{'out tok/s':>11}")
    for v in VARIANTS:
        print(f"{v:<14}{mbs[v]:>11}{mbs[v] * args.depth:>10}{med[v]:>11.1f}")
    print(f"throughput swapping / no swapping: x{statistics.median(ratios):.2f} (per round: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; DejaVu Fig. 9: up to 1.8x)")
    print(f"swap-in: {swap_bytes / 2**20:.0f} MiB in {swap_s:.2f} s ({bandwidth / 2**30:.2f} GiB/s measured), compute thread "
          f"waited {wait_s:.2f} s: {hidden:.0%} hidden; written back {back_bytes / 2**20:.1f} MiB")
    print(f"simulator swap model at the measured bandwidth: {sim_swap * 1e3:.2f} ms per microbatch swap-in per stage")
    print(f"outputs token-identical across variants and rounds: {same}")

    for r in rounds:
        r.pop("tokens")
    doc = {"config": vars(args), "microbatch": mbs,
           "rounds": rounds, "median_output_tok_per_s": med, "throughput_ratio": statistics.median(ratios),
           "ratio_per_round": ratios, "swap_in_s": swap_s, "swap_wait_s": wait_s, "hidden_fraction": hidden,
           "swap_in_bytes": swap_bytes, "write_back_bytes": back_bytes, "measured_swap_bandwidth_Bps": bandwidth,
           "simulator_swap_in_s_per_step": sim_swap, "token_identical": same}

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for x, v in enumerate(VARIANTS):
            vals = [r["output_tok_per_s"] for r in rounds if r["variant"] == v]
            axes[0].bar(x, med[v], color="tab:gray" if x == 0 else "tab:blue")
            axes[0].scatter([x] * len(vals), vals, color="k", s=10, zorder=3)
        axes[0].set_xticks([0, 1], [f"{v}\n(microbatch {mbs[v]})" for v in VARIANTS])
        axes[0].set_title(f"output tokens/s (x{statistics.median(ratios):.2f})")
        axes[1].bar([0, 1], [swap_s, wait_s], color=["tab:blue", "tab:red"])
        axes[1].set_xticks([0, 1], ["swap-in (background)", "compute waited"])
        axes[1].set_title(f"swap time, {hidden:.0%} hidden")
        axes[1].set_ylabel("seconds (all stages, all rounds)")
        fig.suptitle(f"microbatch swapping, depth {args.depth}, {args.device_blocks} device blocks per stage")
        return fig

    write_results(args.out, doc, draw)

if __name__ == "__main__":
    main()

"""KV streaming on the server's own path: DéjàVu Figure 7 with real worker processes over TCP.

What is timed is the prompt worker's pass (the `busy_s` each step result carries: the stage's
forward, plus whatever KV sending it does on its compute thread), for the same batches of prompts:

  off        colocated depth 1: the same prefill with no KV leaving the worker
  naive      disaggregated (1, 1), each layer's KV sent piece by piece on the compute thread
  buffered   disaggregated (1, 1), each layer's KV packed into one buffer, sent on the compute thread
  overlap    disaggregated (1, 1), packed per layer, sent by the connector's background thread (default)

Every variant runs in its own cluster (`Controller` + worker subprocesses, the exact code
`kvflow serve` runs); the clusters are started together and the rounds interleave the variants
(shuffled order per round) so machine noise hits them alike. Each prompt worker runs on CPU 0 and
everything else on the other CPUs (`--no-pin` leaves placement to the OS), as if the prompt worker
had its machine to itself, as in DéjàVu: the token worker's receiving and the controllers then do
not compete with the timed pass, while the prompt worker's own KV sender thread does. The slowdown of a variant is the
median over rounds of (its prompt-worker busy seconds / off's) - 1; the target is <= 2% (Fig. 7).
Transport bandwidth vs raw sockets/memcpy/file writes is `benchmarks/transports.py`.

    python benchmarks/streaming.py [--model PATH] [--batch 4 --prompt 256 --rounds 7]

Writes results/streaming.json and results/streaming.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = ["off", "naive", "buffered", "overlap"]


def cluster_config(variant: str, args):
    from kvflow.config import ClusterConfig, EngineConfig
    from kvflow.kv.cache import KVLayout
    from kvflow.model.loader import load_config
    from kvflow.sched.scheduler import SchedulerConfig

    # One batch = `batch` whole prompts (budget = batch * prompt, no chunking), so every variant's
    # prompt worker runs exactly the same batches.
    sched = SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt,
                            prefill_chunk_size=args.prompt)
    mc, _ = load_config(args.model)
    need = args.batch * (args.prompt + 16) * (args.rounds + 2)
    engine = EngineConfig(model=args.model, dtype=args.dtype, block_size=16, num_kv_blocks=need // 16 + 64,
                          max_model_len=args.prompt + 64, scheduler=sched)
    KVLayout.for_model(mc, 1, 16, dtype=engine.torch_dtype)  # fails early for a model the cache cannot hold
    common = dict(engine=engine, threads_per_worker=args.threads, microbatch_size=args.batch,
                  prompt_microbatch_size=args.batch, heartbeat_timeout_s=120.0)
    if variant == "off":
        return ClusterConfig(mode="colocated", depth=1, **common)
    return ClusterConfig(mode="disaggregated", prompt_depth=1, token_depth=1, kv_send_mode=variant, **common)


async def one_round(ctrl, variant: str, r: int, args, prompts) -> dict:
    """Send one batch of prompts; return the prompt pipeline's steps for it (tokens, busy seconds)."""
    from kvflow.sched.sampling import SamplingParams

    p = ctrl.pipelines[0]  # colocated, or the prompt pipeline
    before = len(p.step_log)
    # off: one token ends the request at its prefill; disaggregated: a second token is generated on
    # the token worker, i.e. the KV streamed during the prompt pass is used.
    params = SamplingParams(max_tokens=1 if variant == "off" else 2, temperature=0.0, ignore_eos=True)

    async def go(i, prompt):
        last = None
        async for out in ctrl.generate(prompt, params, f"{variant}-{r}-{i}"):
            last = out
        if last is None or last.finish_reason != "length":
            raise RuntimeError(f"{variant}: request {i} ended with {last and last.finish_reason}")

    t0 = time.perf_counter()
    await asyncio.gather(*[go(i, pr) for i, pr in enumerate(prompts)])
    wall = time.perf_counter() - t0
    steps = list(p.step_log)[before:]
    return {"steps": [[s.tokens, s.busy_s] for s in steps], "busy_s": sum(s.busy_s for s in steps), "wall_s": wall}


def pin(ctrls: dict, args) -> dict | None:
    """Each prompt worker on CPU 0, everything else (token workers, this process with the
    controllers' threads) on the other CPUs: as if the prompt worker had a machine of its own, which
    is DéjàVu's setting. The prompt worker's KV sender thread shares CPU 0 with its compute thread,
    so every CPU cycle streaming costs the prompt worker is in its pass time. Without it (or on one
    CPU) the token worker's receiver and the controllers compete with the timed pass for the same
    cores, which a machine per worker would not."""
    cpus = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cpus) < 2:
        return None
    mine, rest = {cpus[0]}, set(cpus[1:])
    os.sched_setaffinity(0, rest)  # (the controllers' loop threads run in this process)
    placed = {}
    for v, ctrl in ctrls.items():
        for name, s in ctrl.stages.items():
            prompt_side = s in ctrl.pipelines[0].stages
            cpu = mine if prompt_side else rest
            for tid in os.listdir(f"/proc/{s.process.pid}/task"):  # every thread, the torch pool included
                os.sched_setaffinity(int(tid), cpu)
            placed[f"{v}/{name}"] = sorted(cpu)
    return placed


async def run(args) -> dict:
    from kvflow.controller.controller import Controller

    rng = random.Random(0)
    vocab = 49152
    ctrls = {}
    try:
        for v in VARIANTS:
            print(f"starting the {v!r} cluster ...", flush=True)
            ctrls[v] = Controller(cluster_config(v, args))
            await ctrls[v].start()
        placed = pin(ctrls, args)
        print(f"CPU placement: {placed}" if placed else "CPU placement: none (the OS schedules every process)", flush=True)
        rounds = {v: [] for v in VARIANTS}
        for r in range(-1, args.rounds):  # round -1 warms every cluster up and is not counted
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
            order = VARIANTS[:]
            rng.shuffle(order)
            for v in order:
                res = await one_round(ctrls[v], v, r, args, prompts)
                if r >= 0:
                    rounds[v].append(res)
            if r >= 0:
                print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{v} {rounds[v][-1]['busy_s'] * 1e3:.0f} ms" for v in VARIANTS),
                      flush=True)
        kv_bytes = {v: sum(s.kv_bytes_sent for s in ctrls[v].stages.values()) for v in VARIANTS}
    finally:
        for c in ctrls.values():
            await c.shutdown()
    shapes = {v: [[t for t, _ in x["steps"]] for x in rounds[v]] for v in VARIANTS}
    same_batches = all(shapes[v] == shapes["off"] for v in VARIANTS)
    out = {"config": vars(args), "same_batches": same_batches, "kv_bytes_sent": kv_bytes, "placement": placed,
           "variants": {}}
    for v in VARIANTS:
        busy = [x["busy_s"] for x in rounds[v]]
        ratio = [b / o["busy_s"] for b, o in zip(busy, rounds["off"])]
        out["variants"][v] = {"busy_s": busy, "busy_median_s": statistics.median(busy),
                              "slowdown_pct": (statistics.median(ratio) - 1) * 100,
                              "slowdown_per_round_pct": [(x - 1) * 100 for x in ratio],
                              "wall_median_s": statistics.median(x["wall_s"] for x in rounds[v]),
                              "steps": [x["steps"] for x in rounds[v]]}
    return out


def main() -> None:
    from kvflow.model.loader import default_model_path

    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="model dtype")
    ap.add_argument("--batch", type=int, default=4, help="prompts per batch")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per variant, interleaved (medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="prompt workers on CPU 0, the rest on the other CPUs (default on; --no-pin: the OS places them)")
    args = ap.parse_args()
    args.model = args.model or str(default_model_path())
    res = asyncio.run(run(args))

    print(f"\nprompt-worker pass, {args.batch} x {args.prompt} tokens, {args.rounds} rounds, {args.dtype}, "
          f"{args.threads} thread(s) per worker; identical batches in every variant: {res['same_batches']}")
    print(f"{'variant':<10}{'busy p50 (ms)':>15}{'slowdown p50':>15}{'wall p50 (ms)':>15}{'KV sent (MB)':>14}")
    for v in VARIANTS:
        d = res["variants"][v]
        print(f"{v:<10}{d['busy_median_s'] * 1e3:>15.1f}{d['slowdown_pct']:>14.1f}%{d['wall_median_s'] * 1e3:>15.1f}"
              f"{res['kv_bytes_sent'][v] / 1e6:>14.1f}")
    write_results(RESULTS / "streaming", res, lambda plt: figure(plt, res))


def figure(plt, res: dict):
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = VARIANTS
    ax[0].boxplot([[b * 1e3 for b in res["variants"][v]["busy_s"]] for v in names], tick_labels=names)
    ax[0].set_ylabel("prompt-worker busy per batch (ms)")
    ax[0].set_title("prompt pass time, per round")
    ax[1].bar(names[1:], [res["variants"][v]["slowdown_pct"] for v in names[1:]], color=["#c44", "#48c", "#4a4"])
    ax[1].axhline(2, color="k", ls="--", lw=1, label="2% target (DéjàVu Fig. 7)")
    ax[1].set_ylabel("slowdown vs streaming off (%)")
    ax[1].set_title("median slowdown")
    ax[1].legend()
    return fig

if __name__ == "__main__":
    main()

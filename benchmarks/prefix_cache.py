"""Prefix caching on a workload of requests sharing system prompts: off, device tier only, device +
host, device + host + disk.

The real default model (SmolLM2-135M, dtype auto) in the single-process engine that `kvflow serve`
runs (`LLMEngine`, stepped here directly so no HTTP time blurs the comparison). Workload (seed 0):
`--systems` system prompts whose lengths are drawn from the Azure conversation trace's prompt lengths
(its 1,000-request sample in `benchmarks/traces/`, clipped to [--min-system, --max-system]); each of
`--requests` requests is one of them (round robin, shuffled) + a user message of 8-24 random token ids,
with `--max-tokens` greedy output tokens (ignore_eos). Requests arrive in waves of `--wave` (each
wave once the previous one finished, TTFT from the wave's start; `--wave 0`: all at once). The
device KV cache holds `--device-blocks` blocks (small on purpose, so cached system prompts are
evicted between their uses); the host tier `--host-blocks`, and in the disk variant a host tier of
`--disk-host-blocks` over a disk tier of `--disk-blocks` (chunk files in a temporary directory).
Each variant runs on a fresh engine (empty tiers) over the same loaded weights, variants rotated
`--reps` times.

Per run: makespan, requests/s, output tokens/s, median TTFT, hit rate per tier (tokens found in it /
tokens looked up at admission), bytes and seconds of tier copies; the table shows medians over reps
and the ratios to prefix caching off. Outputs are checked token-identical across variants.

    python benchmarks/prefix_cache.py [--requests 24] [--systems 6] [--reps 3] [--threads 1]

Writes results/prefix_cache.json and results/prefix_cache.png.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

import numpy as np

from kvflow.bench.report import write_results
from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
TRACE = ROOT / "benchmarks" / "traces" / "AzureLLMInferenceTrace_conv_first1000.csv"


def workload(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    with open(args.trace) as f:
        lengths = np.array([int(r["ContextTokens"]) for r in csv.DictReader(f)])
    sys_lens = np.clip(rng.choice(lengths, args.systems), args.min_system, args.max_system)
    systems = [rng.integers(100, vocab, int(n)).tolist() for n in sys_lens]
    order = rng.permutation(np.arange(args.requests) % args.systems)
    return [systems[k] + rng.integers(100, vocab, int(rng.integers(8, 25))).tolist() for k in order]


VARIANTS = ("off", "device", "device+host", "device+host+disk")


def run_once(model, tokenizer, prompts, args, variant: str) -> dict:
    import tempfile

    from kvflow.config import EngineConfig
    from kvflow.engine.engine import LLMEngine
    from kvflow.kv.cache import KVLayout
    from kvflow.kv.tiers import DISK_SLOT_OVERHEAD
    from kvflow.sched.sampling import SamplingParams

    bpb = KVLayout.for_model(model.cfg, 1, 16, dtype=getattr(__import__("torch"), args.dtype)).bytes_per_block
    host = {"device+host": args.host_blocks, "device+host+disk": args.disk_host_blocks}.get(variant, 0)
    disk = args.disk_blocks if variant == "device+host+disk" else 0
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-disk-") as tmp:
        cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=args.device_blocks, enable_prefix_caching=variant != "off",
                           host_kv_bytes=host * bpb, disk_kv_bytes=disk * (bpb + DISK_SLOT_OVERHEAD), disk_kv_path=tmp)
        eng = LLMEngine(model, tokenizer, cfg)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        wave = args.wave or len(prompts)
        reqs, ttft = [], []
        t0 = time.monotonic()
        for w in range(0, len(prompts), wave):
            start = time.monotonic()
            batch = [eng.add_request(p, params) for p in prompts[w:w + wave]]
            while eng.has_unfinished():
                eng.step()
            ttft += [r.first_token_time - start for r in batch]
            reqs += batch
        makespan = time.monotonic() - t0
        moved = eng.runner.tiers.moved if eng.runner.tiers is not None else {}
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    tiers = eng.kv_manager.tier_stats()
    rates = {t: c.hit_rate for t, c in tiers.items()}
    return {"variant": variant, "makespan_s": makespan, "req_per_s": len(reqs) / makespan,
            "output_tok_per_s": out_tokens / makespan, "ttft_p50_s": statistics.median(ttft),
            "hit_rate": sum(rates.values()), "hit_rate_per_tier": rates,
            "hit_tokens_per_tier": {t: c.hits for t, c in tiers.items()}, "queried_tokens": tiers["device"].queries,
            "evictions_per_tier": {t: c.evictions for t, c in tiers.items()},
            "tier_copies": {ph: {"bytes": b, "seconds": sec} for ph, (b, sec) in moved.items()},
            "kv_blocks": eng.kv_manager.num_blocks, "host_blocks": host, "disk_blocks": disk,
            "tokens": [r.output_token_ids for r in reqs]}


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per variant and repetition")
    ap.add_argument("--systems", type=int, default=6, help="distinct system prompts the requests share")
    ap.add_argument("--min-system", type=int, default=64, help="shortest system prompt (tokens)")
    ap.add_argument("--max-system", type=int, default=192, help="longest system prompt (tokens)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--wave", type=int, default=4, help="requests per wave (0: all at once)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians)")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 where the CPU has native bf16)")
    ap.add_argument("--device-blocks", type=int, default=48, help="device KV cache, blocks of 16 tokens")
    ap.add_argument("--host-blocks", type=int, default=96, help="host tier of the device+host variant")
    ap.add_argument("--disk-host-blocks", type=int, default=16, help="host tier of the device+host+disk variant")
    ap.add_argument("--disk-blocks", type=int, default=96, help="disk tier of the device+host+disk variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--trace", type=Path, default=TRACE,
                    help="Azure trace CSV whose prompt lengths size the system prompts (default: the sample in benchmarks/traces/)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache", help="output stem (.json, .png)")
    args = ap.parse_args()

    import torch

    from kvflow.config import EngineConfig
    from kvflow.model.llama import LlamaModel
    from kvflow.model.loader import load_checkpoint
    from kvflow.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    args.dtype = EngineConfig(dtype=args.dtype).dtype  # "auto" resolved once
    ck = load_checkpoint(None)
    model = LlamaModel.from_state_dict(ck.config, ck.state_dict, dtype=getattr(torch, args.dtype))
    tokenizer = Tokenizer(ck.directory)
    prompts = workload(args, ck.config.vocab_size)
    run_once(model, tokenizer, prompts[:2], args, "off")  # warm-up (kernels, allocator)

    runs = []
    for rep in range(args.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]  # rotated: no variant always first
        for v in order:
            r = run_once(model, tokenizer, prompts, args, v)
            r["rep"] = rep
            runs.append(r)
            tiers = ", ".join(f"{t} {x:.2f}" for t, x in r["hit_rate_per_tier"].items())
            print(f"rep {rep} {v:<17}: {r['makespan_s']:.1f} s, hit rate {tiers}", flush=True)
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)

    keys = ["makespan_s", "req_per_s", "output_tok_per_s", "ttft_p50_s", "hit_rate"]
    med = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in keys} for v in VARIANTS}
    for v in VARIANTS:
        for t in ("device", "host", "disk"):
            vals = [r["hit_rate_per_tier"].get(t, 0.0) for r in runs if r["variant"] == v]
            med[v][f"hit_rate_{t}"] = statistics.median(vals)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"\n{args.requests} requests in waves of {args.wave}, {args.systems} system prompts, {prompt_tokens} prompt tokens, "
          f"{args.max_tokens} output tokens each, {args.dtype}, {args.threads} threads, device {args.device_blocks} blocks, "
          f"host {args.host_blocks} (disk variant: host {args.disk_host_blocks} + disk {args.disk_blocks}); medians of {args.reps} reps")
    print(f"{'variant':<18}{'makespan s':>11}{'req/s':>8}{'out tok/s':>11}{'TTFT p50 s':>12}{'hit device':>11}{'host':>7}{'disk':>7}"
          f"{'thru/off':>9}{'TTFT/off':>9}")
    for v in VARIANTS:
        m = med[v]
        print(f"{v:<18}{m['makespan_s']:>11.2f}{m['req_per_s']:>8.2f}{m['output_tok_per_s']:>11.1f}{m['ttft_p50_s']:>12.3f}"
              f"{m['hit_rate_device']:>11.2f}{m['hit_rate_host']:>7.2f}{m['hit_rate_disk']:>7.2f}"
              f"{m['req_per_s'] / med['off']['req_per_s']:>9.2f}{m['ttft_p50_s'] / med['off']['ttft_p50_s']:>9.2f}")
    ratio = {f"throughput_{v}_over_off": med[v]["req_per_s"] / med["off"]["req_per_s"] for v in VARIANTS[1:]}
    ratio.update({f"ttft_p50_{v}_over_off": med[v]["ttft_p50_s"] / med["off"]["ttft_p50_s"] for v in VARIANTS[1:]})
    print(f"outputs token-identical across variants: {same}")

    for r in runs:
        r.pop("tokens")
    doc = {"config": vars(args), "prompt_tokens": prompt_tokens, "runs": runs, "median": med,
           "ratios": ratio, "token_identical": same, "tiers": ["device", "host", "disk"]}

    def draw(plt):
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        colors = {"off": "tab:gray", "device": "tab:green", "device+host": "tab:blue", "device+host+disk": "tab:purple"}
        for ax, key, label in zip(axes[:2], ("req_per_s", "ttft_p50_s"), ("requests/s", "median TTFT (s)")):
            for x, v in enumerate(VARIANTS):
                vals = [r[key] for r in runs if r["variant"] == v]
                ax.bar(x, med[v][key], color=colors[v])
                ax.scatter([x] * len(vals), vals, color="k", s=10, zorder=3)
            ax.set_xticks(range(len(VARIANTS)), VARIANTS, rotation=15)
            ax.set_title(label)
        bottom = np.zeros(len(VARIANTS))
        for t, c in (("device", "tab:green"), ("host", "tab:blue"), ("disk", "tab:purple")):
            vals = np.array([med[v][f"hit_rate_{t}"] for v in VARIANTS])
            axes[2].bar(range(len(VARIANTS)), vals, bottom=bottom, color=c, label=t)
            bottom += vals
        axes[2].set_xticks(range(len(VARIANTS)), VARIANTS, rotation=15)
        axes[2].set_title("hit rate per tier")
        axes[2].legend()
        fig.suptitle(f"prefix caching tiers, SmolLM2-135M ({args.dtype}), {args.requests} requests over {args.systems} system prompts")
        return fig

    write_results(args.out, doc, draw)

if __name__ == "__main__":
    main()

"""Prefix caching on a workload of requests sharing system prompts: off vs on (device tier).

The real default model (SmolLM2-135M, dtype auto) in the single-process engine that `kvflow serve`
runs (`LLMEngine`, stepped here directly so no HTTP time blurs the comparison). Workload (seed 0):
`--systems` system prompts whose lengths are drawn from the Azure conversation trace's prompt lengths
(`../shared/traces/AzureLLMInferenceTrace_conv.csv`, clipped to [--min-system, --max-system]); each of
`--requests` requests is one of them (round robin, shuffled) + a user message of 8-24 random token ids,
with `--max-tokens` greedy output tokens (ignore_eos). All requests arrive at once (an offline burst:
TTFT includes the queueing the prefill work causes). Each variant runs on a fresh engine (an empty
cache) over the same loaded weights, variants interleaved `--reps` times (off, on, on, off, ...).

Per run: makespan, requests/s, output tokens/s, median TTFT, the cache's hit rate (tokens found
cached / tokens looked up at admission); the table shows medians over reps and the on/off ratios.
Only the device tier exists so far (no host/disk tiers). Outputs are checked token-identical.

    python benchmarks/prefix_cache.py [--requests 8] [--systems 2] [--reps 3] [--threads 1]

Writes results/prefix_cache.json and results/prefix_cache.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def workload(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    with open(args.trace) as f:
        lengths = np.array([int(r["ContextTokens"]) for r in csv.DictReader(f)])
    sys_lens = np.clip(rng.choice(lengths, args.systems), args.min_system, args.max_system)
    systems = [rng.integers(100, vocab, int(n)).tolist() for n in sys_lens]
    order = rng.permutation(np.arange(args.requests) % args.systems)
    return [systems[k] + rng.integers(100, vocab, int(rng.integers(8, 25))).tolist() for k in order]


def run_once(model, tokenizer, prompts, args, on: bool) -> dict:
    from kvflow.config import EngineConfig
    from kvflow.engine.engine import LLMEngine
    from kvflow.sched.sampling import SamplingParams

    cfg = EngineConfig(dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb, enable_prefix_caching=on)
    eng = LLMEngine(model, tokenizer, cfg)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    makespan = time.monotonic() - t0
    out_tokens = sum(len(r.output_token_ids) for r in reqs)
    s = eng.kv_manager.stats
    return {"prefix_caching": on, "makespan_s": makespan, "req_per_s": len(reqs) / makespan,
            "output_tok_per_s": out_tokens / makespan, "ttft_p50_s": statistics.median(r.first_token_time - r.arrival_time for r in reqs),
            "hit_rate": s.hit_rate, "hit_tokens": s.hits, "queried_tokens": s.queries, "evictions": s.evictions,
            "kv_blocks": eng.kv_manager.num_blocks, "tokens": [r.output_token_ids for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--systems", type=int, default=2)
    ap.add_argument("--min-system", type=int, default=64)
    ap.add_argument("--max-system", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache")
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
    run_once(model, tokenizer, prompts[:2], args, False)  # warm-up (kernels, allocator)

    runs = []
    for rep in range(args.reps):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            r = run_once(model, tokenizer, prompts, args, on)
            r["rep"] = rep
            runs.append(r)
            print(f"rep {rep} prefix caching {'on ' if on else 'off'}: {r['makespan_s']:.1f} s, hit rate {r['hit_rate']:.2f}",
                  flush=True)
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)

    keys = ["makespan_s", "req_per_s", "output_tok_per_s", "ttft_p50_s", "hit_rate"]
    med = {on: {k: statistics.median(r[k] for r in runs if r["prefix_caching"] == on) for k in keys} for on in (False, True)}
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"\n{args.requests} requests, {args.systems} system prompts, {prompt_tokens} prompt tokens, {args.max_tokens} "
          f"output tokens each, {args.dtype}, {args.threads} threads, medians of {args.reps} reps (device tier only)")
    print(f"{'prefix caching':<16}{'makespan s':>11}{'req/s':>8}{'out tok/s':>11}{'TTFT p50 s':>12}{'hit rate':>10}")
    for on in (False, True):
        m = med[on]
        print(f"{'on' if on else 'off':<16}{m['makespan_s']:>11.2f}{m['req_per_s']:>8.2f}{m['output_tok_per_s']:>11.1f}"
              f"{m['ttft_p50_s']:>12.2f}{m['hit_rate']:>10.2f}")
    ratio = {"throughput_on_over_off": med[True]["req_per_s"] / med[False]["req_per_s"],
             "ttft_p50_on_over_off": med[True]["ttft_p50_s"] / med[False]["ttft_p50_s"]}
    print(f"on/off: throughput x{ratio['throughput_on_over_off']:.2f}, median TTFT x{ratio['ttft_p50_on_over_off']:.2f}; "
          f"outputs token-identical: {same}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    for r in runs:
        r.pop("tokens")
    doc = {"config": config, "prompt_tokens": prompt_tokens, "runs": runs, "median": {str(k): v for k, v in med.items()},
           "ratios": ratio, "token_identical": same, "tiers": ["device"]}
    jpath = args.out.with_suffix(".json")
    jpath.write_text(json.dumps(doc, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in zip(axes, ("req_per_s", "ttft_p50_s", "hit_rate"), ("requests/s", "median TTFT (s)", "hit rate (device)")):
        for x, on in enumerate((False, True)):
            vals = [r[key] for r in runs if r["prefix_caching"] == on]
            ax.bar(x, med[on][key], color="tab:green" if on else "tab:gray")
            ax.scatter([x] * len(vals), vals, color="k", s=10, zorder=3)
        ax.set_xticks([0, 1], ["off", "on"])
        ax.set_title(label)
    fig.suptitle(f"prefix caching, SmolLM2-135M ({args.dtype}), {args.requests} requests over {args.systems} system prompts")
    fig.tight_layout()
    ppath = args.out.with_suffix(".png")
    fig.savefig(ppath, dpi=120)
    print(f"wrote {jpath} and {ppath}")


if __name__ == "__main__":
    main()

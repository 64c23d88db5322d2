"""Engine benchmark: kvflow vs transformers decode throughput, prefill vs the matmul ceiling, decode vs the memory ceiling.

    python benchmarks/engine.py [--dtype auto] [--threads 2] [--new-tokens 64] [--batches 1 4 16] [--out results/engine]

All variants run in the same process, same weights (the embedded SmolLM2-135M), same dtype for
kvflow and transformers (--dtype auto: bf16 where the CPU has native bf16), same thread count and
the same prompts; ratios are what to read on a noisy machine. Also: start-up (engine construction:
weight prepacking, paged-kernel load) and the decode step at batch 16 against context length with
the paged kernel and with the gather path, interleaved, next to the KV bytes each step must read.
Writes a table to stdout, `engine.json` and `engine.png` to --out.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 times 3?",
    "Describe a cat to someone who has never seen one.",
    "Give me a recipe for pancakes.",
    "Why do leaves change color in autumn?",
]


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The faster of a plain `a @ b` and oneDNN's prepacked linear (the model's prefill path) at n x n x n:
    in bf16 on an AVX512-BF16 CPU the plain matmul reached about half of what the prepacked one, and
    the model's prefill, reach, so the plain one alone is no ceiling (docs/results.md, 2026-11-25 serving)."""
    from kvflow.model.linear import Linear

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = timed(lambda: a @ b, repeats)
    lin = Linear(b)  # a @ b.T through the model's own prepacked path: the same FLOPs
    if lin.packed is not None:
        best = min(best, timed(lambda: lin.prepacked(a), repeats))
    return 2 * n**3 / best / 1e9


def copy_gbps(mb: int = 512, repeats: int = 5) -> float:
    """Memory-copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randn(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), repeats) / 1e9


def read_gbps(mb: int = 512, repeats: int = 5) -> float:
    """Streaming-read bandwidth: a sum over a buffer far larger than the caches (what a decode step does to weights)."""
    src = torch.randn(mb * 2**20 // 4)
    return src.numel() * 4 / timed(lambda: src.sum(), repeats) / 1e9


def load_times() -> dict:
    from kvflow.model.loader import load_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("KVFLOW_CACHE_DIR")
        os.environ["KVFLOW_CACHE_DIR"] = tmp
        try:
            cold = load_checkpoint(None)
            warm = load_checkpoint(None)
        finally:
            if old is None:
                os.environ.pop("KVFLOW_CACHE_DIR")
            else:
                os.environ["KVFLOW_CACHE_DIR"] = old
    assert cold.converted and not warm.converted
    return {"cold_load_s": cold.load_seconds, "warm_load_s": warm.load_seconds}


def kvflow_generate(llm, prompts: list[list[int]], new_tokens: int) -> None:
    from kvflow import SamplingParams

    p = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, p, use_tqdm=False)
    assert all(len(o.token_ids) == new_tokens for o in outs)


def hf_generate(hf, tok, prompts: list[list[int]], new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    assert out.shape[1] == width + new_tokens


def decode_tps(gens: dict, prompts, new_tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per generator: (decode tokens/s, seconds per decode step).

    time(N tokens) - time(1 token) isolates decoding; the generators are timed in turn within each
    repeat so that load changes on a shared machine hit all of them alike; medians over repeats.
    """
    full: dict[str, list[float]] = {k: [] for k in gens}
    first: dict[str, list[float]] = {k: [] for k in gens}
    for gen in gens.values():  # warm-up
        gen(prompts, 2)
    for _ in range(repeats):
        for name, gen in gens.items():
            for n, store in ((new_tokens, full), (1, first)):
                t0 = time.perf_counter()
                gen(prompts, n)
                store[name].append(time.perf_counter() - t0)
    out = {}
    for name in gens:
        dt = statistics.median(full[name]) - statistics.median(first[name])
        out[name] = (len(prompts) * (new_tokens - 1) / dt, dt / (new_tokens - 1))
    return out


def prefill_flops_per_token(cfg, ctx: int) -> float:
    """Matmul FLOPs per prompt token (projections + MLP, attention scores at average context ctx/2)."""
    per_layer = 2 * cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size + cfg.q_size) + 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    attn = 2 * 2 * cfg.num_heads * cfg.head_dim * (ctx / 2)
    return cfg.num_layers * (per_layer + attn)


def decode_vs_context(eng, contexts: list[int], read_gbps: float, repeats: int, batch: int = 16) -> dict:
    """Decode step time at `batch` sequences against context length, paged kernel vs gather path
    (interleaved in each repeat), on the engine's own model and a scratch cache of the same layout;
    the slope is compared with the KV bytes a step must read at the measured streaming-read bandwidth."""
    from kvflow.kv.cache import KVCache, KVLayout
    from kvflow.model.batch import ForwardBatch, SeqSlice

    model, bs, cfg = eng.model, eng.config.block_size, eng.model.cfg
    per_seq = -(-max(contexts) // bs)
    kv = KVCache(KVLayout.for_model(cfg, batch * per_seq, bs, dtype=eng.kv_cache.layout.dtype))
    kv.data.normal_()
    order = torch.randperm(batch * per_seq).tolist()  # blocks scattered, as after a while of serving
    tables = [tuple(order[i * per_seq : (i + 1) * per_seq]) for i in range(batch)]
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    paths = {"kernel": True, "gather": False} if model.paged_kernel else {"gather": False}
    times = {(c, p): [] for c in contexts for p in paths}
    for r in range(repeats + 1):
        for c in contexts:
            fb = ForwardBatch.build([SeqSlice(i, 1, c, tables[i]) for i in range(batch)], bs)
            for p, flag in paths.items():
                model.paged_kernel = flag
                t0 = time.perf_counter()
                model.forward(ids, fb, kv)
                if r:  # the first round warms up
                    times[(c, p)].append(time.perf_counter() - t0)
    model.paged_kernel = "kernel" in paths
    kv_bytes = {c: batch * c * 2 * cfg.num_layers * cfg.kv_size * kv.layout.dtype_bytes for c in contexts}
    rows = [{"context": c, "kv_bytes": kv_bytes[c], **{f"{p}_step_s": statistics.median(times[(c, p)]) for p in paths}} for c in contexts]
    c0, c1 = contexts[0], contexts[-1]
    need = (kv_bytes[c1] - kv_bytes[c0]) / (read_gbps * 1e9)
    out = {"batch": batch, "rows": rows, "required_growth_s": need}
    print(f"\ndecode step at batch {batch} vs context ({kv.layout.dtype}); KV bytes read per step at the streaming-read "
          f"bandwidth would add {1e3 * need:.1f} ms from {c0} to {c1} tokens")
    print(f"{'context':>8} {'KV MB':>7} " + " ".join(f"{p + ' ms':>10}" for p in paths))
    for row in rows:
        print(f"{row['context']:>8} {row['kv_bytes'] / 1e6:>7.0f} " + " ".join(f"{1e3 * row[p + '_step_s']:>10.1f}" for p in paths))
    for p in paths:
        grow = rows[-1][f"{p}_step_s"] - rows[0][f"{p}_step_s"]
        out[f"{p}_growth_s"] = grow
        print(f"{p}: step grows {1e3 * grow:.1f} ms from {c0} to {c1} tokens = {grow / need:.2f}x what the KV bytes require")
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for every variant")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per timed run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    ap.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill measurement")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per variant (medians)")
    ap.add_argument("--out", default="results/engine", help="output directory (engine.json, engine.png)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has native bf16, else float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048],
                    help="context lengths of the batch-16 decode-step sweep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from transformers import LlamaForCausalLM

    from kvflow import LLM

    from kvflow.config import resolve_dtype

    dtype, why = resolve_dtype(args.dtype)
    print(f"threads={args.threads}  new_tokens={args.new_tokens}  batches={args.batches}  dtype={dtype} ({why})")
    res: dict = {"threads": args.threads, "new_tokens": args.new_tokens, "dtype": dtype}
    res.update(load_times())
    print(f"checkpoint load: cold (GGUF conversion) {res['cold_load_s']:.2f}s, warm (cached) {res['warm_load_s']:.3f}s")
    t0 = time.perf_counter()
    # prefix caching off: the repeats send the same prompts, and a cached prefix would skip the prefill
    # the benchmark times (with it on, the reported prefill rate was far above the matmul ceiling)
    llm = LLM(dtype=dtype, num_threads=args.threads, max_num_seqs=64, max_num_batched_tokens=1024, prefill_chunk_size=1024,
              enable_prefix_caching=False)
    res["engine_start_s"] = time.perf_counter() - t0
    eng = llm.engine
    tok = llm.tokenizer
    print(f"engine start-up (load + weight prepacking + paged kernel load): {res['engine_start_s']:.2f}s")
    hf = LlamaForCausalLM.from_pretrained(str(eng.checkpoint.directory), dtype=getattr(torch, dtype)).eval()  # the same converted weights
    res["ceiling_matmul_gflops"] = matmul_gflops(dtype=getattr(torch, dtype))  # in the run's dtype
    res["ceiling_copy_gbps"] = copy_gbps()
    res["ceiling_read_gbps"] = read_gbps()
    print(f"ceilings: matmul {res['ceiling_matmul_gflops']:.1f} GFLOP/s, memory copy {res['ceiling_copy_gbps']:.1f} GB/s "
          f"(read+write), streaming read {res['ceiling_read_gbps']:.1f} GB/s")

    rows = []
    for b in args.batches:
        prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(b)]
        gens = {"kvflow": lambda p, n: kvflow_generate(llm, p, n), "hf": lambda p, n: hf_generate(hf, tok, p, n)}
        r = decode_tps(gens, prompts, args.new_tokens, args.repeats)
        (k_tps, k_step), (h_tps, h_step) = r["kvflow"], r["hf"]
        print(f"  batch {b}: kvflow {k_tps:.1f} tok/s, transformers {h_tps:.1f} tok/s", flush=True)
        rows.append({"batch": b, "kvflow_tok_s": k_tps, "hf_tok_s": h_tps, "speedup": k_tps / h_tps, "kvflow_step_s": k_step, "hf_step_s": h_step})
    res["decode"] = rows

    # (b) prefill throughput vs the matmul ceiling: 4 prompts of --prefill-len tokens, one token generated.
    cfg = eng.model.cfg
    base = tok.encode(" ".join(QUESTIONS * 40))
    prompts = [base[i * 7 : i * 7 + args.prefill_len] for i in range(4)]
    t = timed(lambda: kvflow_generate(llm, prompts, 1), args.repeats)
    prefill_tps = 4 * args.prefill_len / t
    achieved = prefill_tps * prefill_flops_per_token(cfg, args.prefill_len) / 1e9
    res["prefill"] = {"tokens_per_s": prefill_tps, "achieved_gflops": achieved, "fraction_of_matmul_ceiling": achieved / res["ceiling_matmul_gflops"]}

    # (c) decode step at batch 1 vs weight bytes / read bandwidth (every weight is read once per step).
    wbytes = eng.model.weight_bytes
    floor = wbytes / (res["ceiling_read_gbps"] * 1e9)
    copy_floor = wbytes / (res["ceiling_copy_gbps"] * 1e9)  # the definition: weight bytes / copy bandwidth
    step1 = rows[0]["kvflow_step_s"] if rows and rows[0]["batch"] == 1 else float("nan")
    res["memory"] = {
        "weight_bytes": wbytes,
        "read_floor_s": floor,
        "copy_floor_s": copy_floor,
        "kvflow_step_b1_s": step1,
        "fraction_of_memory_ceiling": floor / step1,
        "fraction_of_copy_ceiling": copy_floor / step1,
    }

    print(f"\n{'batch':>5} {'kvflow tok/s':>13} {'transformers tok/s':>19} {'speedup':>8} {'kvflow ms/step':>15} {'hf ms/step':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['kvflow_tok_s']:>13.1f} {r['hf_tok_s']:>19.1f} {r['speedup']:>7.2f}x {1e3 * r['kvflow_step_s']:>15.1f} {1e3 * r['hf_step_s']:>11.1f}")
    p = res["prefill"]
    print(f"\nprefill: {p['tokens_per_s']:.0f} tok/s = {p['achieved_gflops']:.1f} GFLOP/s = {100 * p['fraction_of_matmul_ceiling']:.0f}% of the matmul ceiling")
    m = res["memory"]
    print(f"decode b=1: {1e3 * m['kvflow_step_b1_s']:.1f} ms/step for {m['weight_bytes'] / 1e6:.0f} MB of weights; "
          f"floor at streaming-read bandwidth {1e3 * m['read_floor_s']:.1f} ms ({100 * m['fraction_of_memory_ceiling']:.0f}% reached), "
          f"at copy bandwidth {1e3 * m['copy_floor_s']:.1f} ms ({100 * m['fraction_of_copy_ceiling']:.0f}% reached)")
    res["decode_vs_context"] = decode_vs_context(eng, args.contexts, res["ceiling_read_gbps"], args.repeats + 2)
    (out_dir / "engine.json").write_text(json.dumps(res, indent=2))
    plot(res, out_dir / "engine.png")
    print(f"\nwrote {out_dir / 'engine.json'} and {out_dir / 'engine.png'}")


def plot(res: dict, path: Path) -> None:
    from kvflow.plotting import pyplot

    plt = pyplot()

    rows = res["decode"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(rows))
    ax1.bar([x - 0.2 for x in xs], [r["kvflow_tok_s"] for r in rows], 0.4, label="kvflow")
    ax1.bar([x + 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="transformers generate()")
    for x, r in zip(xs, rows):
        ax1.text(x - 0.2, r["kvflow_tok_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax1.set_ylabel("decode tokens/s")
    ax1.set_title(f"Decode throughput, SmolLM2-135M fp32, {res['threads']} threads")
    ax1.legend()
    p, m = res["prefill"], res["memory"]
    ax2.bar(["prefill\n(of matmul FLOP/s)", "decode b=1\n(of weight-read floor)"], [100 * p["fraction_of_matmul_ceiling"], 100 * m["fraction_of_memory_ceiling"]])
    ax2.axhline(100, color="gray", linestyle="--")
    ax2.set_ylabel("% of hardware ceiling measured in the same run")
    ax2.set_title("Distance to the roofline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

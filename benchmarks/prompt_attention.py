"""One layer's prompt attention, three ways: PyTorch's SDPA, the AMX kernel and the paged kernel.

    python benchmarks/prompt_attention.py [--lengths 128 256 512 1024 2048]

SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64), bf16, one torch thread, 128-token
cache blocks: a whole prompt of each length, and a 512-token chunk after 512 cached tokens (SDPA then
over K/V gathered from the cache and masked, as the model does). Thread CPU time, the three paths
interleaved, the best of 5 passes after a warm-up (on a shared machine only a pass's own slowness
counts). The AMX column needs `cpu_kernels.fast_prefill_available` (AMX and bf16). Writes
results/prompt_attention.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter
from kvflow.model import cpu_kernels, prompt_attention
from kvflow.model.batch import SeqSlice


RESULTS = Path(__file__).resolve().parents[1] / "results"


def main(lens: list[int]) -> None:
    torch.set_num_threads(1)
    if not cpu_kernels.available():
        sys.exit("no CPU kernels here")
    H, KVH, D, BS = 9, 3, 64, 128
    scale, amx = D**-0.5, cpu_kernels.fast_prefill_available(torch.bfloat16, D, H, KVH)
    gen = torch.Generator().manual_seed(0)
    print("chunk/context  sdpa_ms  amx_ms  paged_ms  sdpa/amx")
    rows = []
    for ql, c in [(n, n) for n in lens] + [(512, 1024)]:
        nb = -(-c // BS)
        kv = torch.randn(2, nb, BS, KVH, D, generator=gen).bfloat16()
        q = torch.randn(ql, H, D, generator=gen).bfloat16()
        table = torch.arange(nb)[None]
        start, qlen, ctx = (torch.tensor([x], dtype=torch.long) for x in (0, ql, c))
        s = SeqSlice(0, ql, c, tuple(range(nb)))

        def sdpa():  # a whole prompt over its fresh K/V (views here); a chunk over K/V gathered from the cache
            if ql == c:
                k, v = kv[0].reshape(-1, KVH, D)[:c], kv[1].reshape(-1, KVH, D)[:c]
                return prompt_attention.attend_chunk(q, k, v, s, scale, H // KVH, None)
            k, v = kv[0][table[0]].reshape(-1, KVH, D)[:c], kv[1][table[0]].reshape(-1, KVH, D)[:c]
            return prompt_attention.attend_chunk(q, None, None, s, scale, H // KVH, (k, v))

        paths = {"sdpa": sdpa,
                 "paged": lambda: cpu_kernels.paged_prefill_attention(q, kv, table, start, qlen, ctx, scale)}
        if amx:
            paths["amx"] = lambda: cpu_kernels.paged_prefill_attention_fast(q, kv, table, start, qlen, ctx, scale)
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for rep in range(6):
                for name, run in paths.items():
                    t0 = time.thread_time()
                    run()
                    if rep:
                        best[name] = min(best[name], time.thread_time() - t0)
        a = best.get("amx", float("nan"))
        print(f"{ql}/{c}".ljust(14), f"{best['sdpa'] * 1e3:7.2f}", f"{a * 1e3:7.2f}", f"{best['paged'] * 1e3:9.2f}",
              f"{best['sdpa'] / a:9.2f}", flush=True)
        rows.append({"chunk": ql, "context": c, **{f"{name}_ms": t * 1e3 for name, t in best.items()}})
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "prompt_attention.json"
    out.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "amx": amx, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                    help="prompt lengths (tokens) of the whole-prompt rows")
    main(ap.parse_args().lengths)

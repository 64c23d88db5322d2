"""Attention of prompt chunks through PyTorch's `scaled_dot_product_attention`, and when to use it.

kvflow's paged CPU kernel (`cpu_kernels.paged_prefill_attention`) attends every prompt chunk of a step in
one call, reading K/V in place, with one fixed reduction order per row: a token's output is the same
in a chunk of any length or as a decode row, which is what batch-invariant (`--deterministic`) serving
needs. Its dot products are vector instructions, though, and on a CPU with matrix units PyTorch's
flash attention (blocked GEMMs through oneDNN's brgemm, AMX tiles where present) attends a long
prompt chunk several times faster, even with the chunk's cached context gathered from the cache and
masked. Its blocks depend on the lengths, so a row's result depends on how the prompt was chunked:
it is a fast-path choice, never taken by a batch-invariant model.

On a CPU with AMX, bf16, a native flash-attention kernel on AMX tiles
(`cpu_kernels.paged_prefill_attention_fast`, also not batch-invariant) beats both on long chunks and
attends every such chunk of a step in one call, K/V read in place.

`choose_prompt_paths` decides, per machine, from which chunk length a prompt chunk goes to the AMX
kernel and from which to SDPA (shorter ones: the paged kernel); `attend_chunk` is the per-sequence
SDPA call, also the fallback of every prompt chunk where the paged kernel is not built.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from kvflow.model import cpu_kernels
from kvflow.model.batch import SeqSlice

# Prompt lengths timed at load; a longer chunk takes the choice of the longest.
MEASURED_LENS = (16, 32, 64, 128, 256, 512, 1024)
_CHOSEN: dict[tuple, int | None] = {}


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: SeqSlice, scale: float, group: int,
                 past_kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One sequence's prompt chunk: q [ql, H, hd] -> [ql, H, hd]. A whole prompt (`past_kv` None)
    attends causally to its own fresh k, v [ql, kvh, hd]; a chunk after cached context attends to
    `past_kv` (its sequence's K and V [context_len, kvh, hd], the chunk's own included) under a mask."""
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, ql, hd]
    mask, causal = None, past_kv is None
    if past_kv is not None:
        k, v = past_kv
        past = s.context_len - s.query_len
        qpos = torch.arange(s.query_len, device=q.device)[:, None] + past
        mask = torch.arange(s.context_len, device=q.device)[None, :] <= qpos
    o = F.scaled_dot_product_attention(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1)
    return o.squeeze(0).transpose(0, 1)


def choose_prompt_paths(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int | None, int | None]:
    """(amx_from, sdpa_from): from which chunk length a prompt chunk goes to the AMX kernel
    (`cpu_kernels.paged_prefill_attention_fast`) and from which to SDPA on this CPU (None: never);
    shorter chunks take the paged kernel. Timed on one layer's whole prompt at `MEASURED_LENS` (random
    q/K/V; paged, SDPA and, where `fast_prefill_available`, the AMX kernel interleaved; the best of 5
    passes after a warm-up: another process can only make a pass slower). SDPA must win at every
    measured length from sdpa_from on, the AMX kernel at every one from amx_from up to sdpa_from.
    `KVFLOW_PROMPT_ATTENTION=paged|amx|sdpa` sets it without measuring (amx where the kernel runs here,
    else paged). Cached per shape, dtype and torch thread count. Call `cpu_kernels.available()` first."""
    amx = cpu_kernels.fast_prefill_available(dtype, head_dim, num_heads, num_kv_heads)
    forced = os.environ.get("KVFLOW_PROMPT_ATTENTION")
    if forced:
        if forced not in ("paged", "amx", "sdpa"):
            raise ValueError(f"KVFLOW_PROMPT_ATTENTION must be paged, amx or sdpa, not {forced!r}")
        # (every prompt chunk has 2 tokens or more)
        return (2 if forced == "amx" and amx else None), (2 if forced == "sdpa" else None)
    key = (num_heads, num_kv_heads, head_dim, dtype, torch.get_num_threads())
    if key not in _CHOSEN:
        winners = [_fastest(n, num_heads, num_kv_heads, head_dim, dtype, amx) for n in MEASURED_LENS]
        chosen = {"sdpa": None, "amx": None}
        band = "sdpa"  # from the longest length down: SDPA's band, then the AMX kernel's
        for n, win in zip(reversed(MEASURED_LENS), reversed(winners)):
            if win != band:
                if band == "amx" or win != "amx":
                    break
                band = "amx"
            chosen[band] = n
        _CHOSEN[key] = (chosen["amx"], chosen["sdpa"])
    return _CHOSEN[key]


def _fastest(n: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, amx: bool) -> str:
    block = 16
    blocks = -(-n // block)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    kv_layer = torch.randn(2, blocks, block, num_kv_heads, head_dim, generator=gen).to(dtype)
    k = kv_layer[0].reshape(-1, num_kv_heads, head_dim)[:n]
    v = kv_layer[1].reshape(-1, num_kv_heads, head_dim)[:n]
    table = torch.arange(blocks, dtype=torch.long)[None, :]
    start, qlen, ctx = (torch.tensor([x], dtype=torch.long) for x in (0, n, n))
    s, scale, group = SeqSlice(0, n, n, tuple(range(blocks))), head_dim**-0.5, num_heads // num_kv_heads
    paths = {
        "paged": lambda: cpu_kernels.paged_prefill_attention(q, kv_layer, table, start, qlen, ctx, scale),
        "sdpa": lambda: attend_chunk(q, k, v, s, scale, group, None),
    }
    if amx:
        paths["amx"] = lambda: cpu_kernels.paged_prefill_attention_fast(q, kv_layer, table, start, qlen, ctx, scale)
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for rep in range(6):
            for name, run in paths.items():
                t0 = time.perf_counter()
                run()
                if rep:
                    best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.get)

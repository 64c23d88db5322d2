"""Paged attention for GPUs, in Triton: every query row of a step attends to its sequence's K/V read
in place from the paged cache (no gather into a padded copy, no per-sequence launch).

One kernel serves prompt chunks (with or without cached context before them) and decode rows. A
program takes BLOCK_Q query tokens of one sequence and the GROUP query heads that share one KV head
(grouped-query attention: the K/V tile is read once for all of them), and walks the sequence's keys
in tiles of BLOCK_N positions with an online softmax in float32.

Batch invariance holds by construction: every call uses the same tile sizes, key tiles start at
absolute positions 0, BLOCK_N, 2*BLOCK_N, ... whatever the batch, and a row's result depends only
on its own query, its own keys and that fixed order (rows of a tile share no reduction; a key tile
past a row's position is fully masked and leaves its running max, sum and output exactly as they
were). So a request's tokens do not depend on what else is in its step, nor on how its prompt was
chunked. This kernel does not split a row's keys across programs: merging partial softmaxes would
tie a row's rounding to the split, which would have to be fixed per position to stay invariant.

At small decode batches that leaves most of the GPU idle (one program per sequence and KV head walks
the whole context), so a model that is not batch-invariant attends its decode rows with
`paged_decode` instead: each context cut into slices computed by programs of their own and merged
("flash decoding"), as many slices as fill the device for the batch's shape (once
`split_decode_works` has checked it against this kernel on the device).

Under `TRITON_INTERPRET=1` the same kernel runs on CPU tensors (slowly), which is how CI tests it.
The interpreter multiplies half-precision matrices wrongly (it sees their raw bits), so there the
dots take float32 copies of the same values: the products are exact either way, only the order of
the float32 sums may differ from the GPU's. float32 dots are IEEE (no TF32) everywhere.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: `available` is False and nothing below is called
    triton = None

log = logging.getLogger(__name__)

BLOCK_Q = 16  # query tokens per program
BLOCK_N = 32  # keys per tile of the walk over the context
# No software pipelining of the key walk: each tile's loads hang on a block-table lookup, and on an
# H200 the pipelined variants (2-3 stages) ran decode calls slower (docs/results.md, 2026-11-27
# GPU). The same stages for every call: the arithmetic, and so batch invariance, do not depend on it.
NUM_STAGES = 1


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """The kernel runs on `device`: a CUDA device with Triton, or any tensor under the interpreter."""
    return triton is not None and (device.type == "cuda" or interpreted())


if triton is not None:

    @triton.jit
    def _key_tile(q, m_i, l_i, acc, n0, last, pos, table_row_ptr, k_ptr, v_ptr, kv_head, scale,
                  stride_kb, stride_ks, stride_kh,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        """One step of the online softmax: keys n0 .. n0 + BLOCK_N - 1 (those below `last`, and for each
        row those at or before its position `pos`) read in place through the row's block table, folded
        into the rows' running max `m_i`, sum `l_i` and unnormalised output `acc`."""
        d = tl.arange(0, HEAD_DIM)
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < last
        block = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=key_ok, other=0)
        kv_off = block[:, None] * stride_kb + (n % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (n[None, :] <= pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:  # p rounded to the cache's dtype first, as the half-precision dot below takes it
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr,
        scale,
        stride_qt, stride_qh, stride_ot, stride_oh,  # q and out: [T, H, D], last dim contiguous
        stride_kb, stride_ks, stride_kh,  # K and V cache: [num_blocks, block_size, kv_heads, D]
        stride_tab,  # block table: [num_seqs, max_blocks]
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(q_len_ptr + seq)
        if tile * BLOCK_Q >= q_len:  # this sequence has fewer query tiles than the longest
            return
        q_start = tl.load(q_start_ptr + seq)
        ctx_len = tl.load(ctx_len_ptr + seq)

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        m = tl.arange(0, BLOCK_M)
        tok = tile * BLOCK_Q + m // GROUP_PAD  # query token within the chunk
        g = m % GROUP_PAD  # query head within the group
        row_ok = (tok < q_len) & (g < GROUP)
        pos = ctx_len - q_len + tok  # the token's position: it sees keys 0..pos
        d = tl.arange(0, HEAD_DIM)
        head = kv_head * GROUP + g
        q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        last = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_Q)  # keys this tile's rows can see
        for n0 in range(0, last, BLOCK_N):
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, n0, last, pos, table_ptr + seq * stride_tab, k_ptr, v_ptr, kv_head,
                                      scale, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, UPCAST)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


if triton is not None:

    @triton.jit
    def _decode_part_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, ctx_len_ptr, m_ptr, l_ptr, acc_ptr,
        scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tab,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """One decode row's query heads of one KV head over one of PARTS equal slices of its context:
        the slice's running max, sum and unnormalised output, for `_decode_merge_kernel`."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        ctx_len = tl.load(ctx_len_ptr + seq)
        part_len = tl.cdiv(tl.cdiv(ctx_len, PARTS), BLOCK_N) * BLOCK_N  # the sequence's own slices
        start = part * part_len
        if start >= ctx_len:
            return
        end = tl.minimum(start + part_len, ctx_len)
        row = tl.load(rows_ptr + seq)
        g = tl.arange(0, ROWS)
        g_ok = g < GROUP
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        pos = tl.full([ROWS], 0, tl.int64) + ctx_len - 1  # (a decode row sees its whole context)
        for n0 in range(start, end, BLOCK_N):  # (every slice holds a key: the running max is finite)
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, n0, end, pos, table_ptr + seq * stride_tab, k_ptr, v_ptr, kv_head,
                                      scale, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, UPCAST)
        at = (seq * (GROUP * tl.num_programs(1)) + head) * PARTS + part  # [seq, head, part]
        tl.store(m_ptr + at, m_i, mask=g_ok)
        tl.store(l_ptr + at, l_i, mask=g_ok)
        tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, rows_ptr, ctx_len_ptr, out_ptr, stride_ot, stride_oh,
                             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
        """One decode row's head: its context's slices combined in order, normalised, stored."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        ctx_len = tl.load(ctx_len_ptr + seq)
        part_len = tl.cdiv(tl.cdiv(ctx_len, PARTS), BLOCK_N) * BLOCK_N
        d = tl.arange(0, HEAD_DIM)
        base = (seq * tl.num_programs(1) + head) * PARTS
        m = tl.load(m_ptr + base)
        l_sum = tl.load(l_ptr + base)
        acc = tl.load(acc_ptr + base * HEAD_DIM + d)
        for part in range(1, tl.cdiv(ctx_len, part_len)):
            m_p = tl.load(m_ptr + base + part)
            m_new = tl.maximum(m, m_p)
            a, b = tl.exp(m - m_new), tl.exp(m_p - m_new)
            l_sum = l_sum * a + tl.load(l_ptr + base + part) * b
            acc = acc * a + tl.load(acc_ptr + (base + part) * HEAD_DIM + d) * b
            m = m_new
        row = tl.load(rows_ptr + seq)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, (acc / l_sum).to(out_ptr.dtype.element_ty))


MAX_DECODE_PARTS = 16


def decode_parts(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """How many slices `paged_decode` cuts each context into: enough programs to fill the device
    twice over (one per sequence, KV head and slice), at most MAX_DECODE_PARTS; 1 once the batch
    alone fills it. A function of the batch's shape only, so a captured CUDA graph keeps it."""
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 132
    return max(1, min(MAX_DECODE_PARTS, -(-2 * sms // max(1, num_seqs * kv_heads))))


@functools.cache
def split_decode_works(device: torch.device) -> bool:
    """Whether `paged_decode` runs on `device` and agrees with `paged_attention` there (float32, a
    context over several slices; checked once per process and device). A model that is not
    batch-invariant uses it only then; otherwise it logs why and keeps the one-program-per-head kernel,
    as a CUDA graph that cannot be captured falls back to eager steps."""
    try:
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(2, 8, 16, 2, 32, generator=g).to(device)
        q = torch.randn(2, 4, 32, generator=g).to(device)
        table = torch.tensor([[3, 1, 6, 0, 5], [2, 7, 4, 4, 4]], device=device)
        rows, ctx = torch.tensor([0, 1], device=device), torch.tensor([77, 40], device=device)
        split = paged_decode(q, cache, table, rows, ctx, 0.125, torch.zeros_like(q), parts=3)
        whole = paged_attention(q, cache, table, rows, torch.ones_like(rows), ctx, 1, 0.125, torch.zeros_like(q))
        if not torch.allclose(split, whole, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"it differs from paged_attention by {float((split - whole).abs().max()):.3g}")
        return True
    except Exception as e:  # a Triton or driver that cannot compile or run it
        log.warning("split decode attention unavailable on %s (%s: %s); decode rows use the per-head kernel",
                    device, type(e).__name__, e)
        return False


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor, parts: int | None = None) -> torch.Tensor:
    """Decode rows (one query token each, at the end of its context) attended with each context
    split into `parts` slices computed in parallel and merged (split-K, "flash decoding"): at small
    batches the one-program-per-KV-head walk of `paged_attention` leaves most of the GPU idle. The
    result depends on how many slices the batch's shape gives, so it is not batch-invariant
    (`LlamaModel` uses it only when not deterministic). `parts` None: `decode_parts`; 1 runs
    `paged_attention`."""
    num_seqs = rows.numel()
    if num_seqs == 0:
        return out
    _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
    heads = q.shape[1]
    parts = decode_parts(num_seqs, kv_heads, q.device) if parts is None else parts
    if parts == 1:
        ones = torch.ones_like(rows)
        return paged_attention(q, kv_layer, block_table, rows, ones, context_lens, 1, scale, out)
    if heads % kv_heads or q.stride(-1) != 1 or out.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("paged_decode: heads must be a multiple of kv_heads and the last dims contiguous")
    group = heads // kv_heads
    f32 = dict(dtype=torch.float32, device=q.device)
    m = torch.empty(num_seqs, heads, parts, **f32)
    l_sum = torch.empty(num_seqs, heads, parts, **f32)
    acc = torch.empty(num_seqs, heads, parts, head_dim, **f32)
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    _decode_part_kernel[(num_seqs, kv_heads, parts)](
        q, k_cache, v_cache, block_table, rows, context_lens, m, l_sum, acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N, PARTS=parts, UPCAST=q.dtype == torch.float32 or interpreted(), num_stages=NUM_STAGES,
    )
    _decode_merge_kernel[(num_seqs, heads)](m, l_sum, acc, rows, context_lens, out, out.stride(0), out.stride(1),
                                            HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, PARTS=parts)
    return out


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
                    query_len: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """Attention of the sequences described by (`query_start`, `query_len`, `context_lens`,
    `block_table` rows) into the rows of `out` they own; other rows of `out` are left as they are.

    q, out: [T, H, D]; kv_layer: [2, num_blocks, block_size, kv_heads, D] (one layer of the cache, this
    step's K/V already written); block_table: [S, max_blocks] (padded); query_len <= context_lens;
    `max_query_len`: the largest of `query_len`, known on the host (1 for decode rows)."""
    num_seqs = query_len.numel()
    if num_seqs == 0:
        return out
    _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
    heads = q.shape[1]
    if heads % kv_heads or q.stride(-1) != 1 or out.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("paged_attention: heads must be a multiple of kv_heads and the last dims contiguous")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged_attention: head_dim {head_dim} must be a power of two >= 16")
    group = heads // kv_heads
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    grid = (num_seqs, kv_heads, triton.cdiv(max_query_len, BLOCK_Q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, query_start, query_len, context_lens,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 1), HEAD_DIM=head_dim,
        BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, UPCAST=q.dtype == torch.float32 or interpreted(),
        num_stages=NUM_STAGES,
    )
    return out

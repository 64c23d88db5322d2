"""A decode step's projections with the layer's elementwise pass before them in the same kernel: on
CUDA, at a few rows, one kernel where `triton_fused` and cuBLAS take two.

- `add_norm_linear(x, delta, norm_weight, weight, eps)`: the residual add and RMS norm, then the
  projection (the qkv projection after the input norm, gate_up after the post-attention norm);
- `silu_linear(gate_up, weight)`: SiLU(gate) x up, then the down projection.

At a decode batch of a few rows, a layer's projections are matrix-vector products of small matrices
whose kernels take little more than their launch and one trip to memory; so do the norm's and SiLU's.
Fusing them takes two of the ten kernels a layer ran on CUDA (three: the residual add and norm
before the qkv and gate_up projections, SiLU x up before down), a step's graph that much shorter.
Whether that is faster than cuBLAS's GEMV on a given card is measured when a model loads
(`decode_fusion`), and the fused kernels run only where it is.

A program computes BLOCK_N output columns of one row over the whole inner dimension at once (it
loads its [BLOCK_N, K] slice of the weight in one go: the row counts here are latency-bound, not
bandwidth-bound), after computing the row's prologue itself: every program of a row reads the whole
row (hidden 576 or intermediate 1536 values: a few KB, from cache after the first) and rounds it as
`triton_fused`'s kernels do, through the same helper functions. The norm kernel's sum of squares is
one reduction over the padded row in both; whether a compiled GPU reduction orders its adds the same
in the two kernels is up to the compiler, so the results are equal to the separate kernels' within
a last-bit rounding of 1/RMS, not promised bitwise. The product accumulates in float32 and is
rounded once, as cuBLAS's is, in its own order. Nothing here is batch-invariant by promise
(`deterministic` models never take it). Under `TRITON_INTERPRET=1` the kernels run on CPU tensors,
which is how CI tests them.
"""

from __future__ import annotations

import torch

from kvflow.model.triton_attention import triton

if triton is not None:
    import triton.language as tl

    from kvflow.model.triton_fused import rms_inverse, rms_scale, silu_times

# Weight elements a program loads (BLOCK_N x the padded inner dimension): a register tile of 64
# float32 values a thread at 4 warps. Wider inner dimensions (BLOCK_K above this) are not offered.
TILE = 8192


if triton is not None:

    @triton.jit
    def _norm_linear_kernel(x_ptr, d_ptr, nw_ptr, w_ptr, y_ptr, sum_ptr, N, K, eps,
                            ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        ok = k < K
        x = tl.load(x_ptr + row * K + k, mask=ok, other=0.0)
        if ADD:  # x + delta, rounded to the dtype as `add_rms_norm` rounds it
            x = (tl.load(d_ptr + row * K + k, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            if cols == 0:  # one program per row writes the sum (to a buffer no program reads)
                tl.store(sum_ptr + row * K + k, x, mask=ok)
        h = rms_scale(x, rms_inverse(x, K, eps), tl.load(nw_ptr + k, mask=ok, other=0.0)).to(tl.float32)
        n = cols * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=(n < N)[:, None] & ok[None, :], other=0.0)
        y = tl.sum(w.to(tl.float32) * h[None, :], 1)
        tl.store(y_ptr + row * N + n, y.to(y_ptr.dtype.element_ty), mask=n < N)

    @triton.jit
    def _silu_linear_kernel(gu_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        k = tl.arange(0, BLOCK_K)
        ok = k < K
        g = tl.load(gu_ptr + row * 2 * K + k, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * 2 * K + K + k, mask=ok, other=0.0)
        a = silu_times(g, u).to(tl.float32)
        n = cols * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=(n < N)[:, None] & ok[None, :], other=0.0)
        y = tl.sum(w.to(tl.float32) * a[None, :], 1)
        tl.store(y_ptr + row * N + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


def supported(inner: int) -> bool:
    """Whether a projection over `inner` input values fits the kernels' tile (Triton installed)."""
    return triton is not None and 0 < triton.next_power_of_2(inner) <= TILE


def _tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the whole padded inner dimension, as many columns as fill `TILE`."""
    if not supported(k):
        raise ValueError(f"a fused projection takes an inner dimension of at most {TILE}, not {k}")
    block_k = triton.next_power_of_2(k)
    return min(TILE // block_k, triton.next_power_of_2(n)), block_k


def _check(name: str, weight: torch.Tensor, *rows: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"{name}: the weight must be [out, in], contiguous")
    for t in rows:
        if t.dim() != 2 or not t.is_contiguous() or t.dtype != weight.dtype or t.device != weight.device:
            raise ValueError(f"{name}: rows must be 2-D, contiguous, on the weight's device and in its dtype")


def add_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) @ weight.T) where s = x + delta (a new tensor; x itself when `delta` is None):
    x, delta [T, D], norm_weight [D], weight [N, D], one dtype, contiguous. The same values as
    `triton_fused.add_rms_norm` (or `rms_norm`) then a projection, up to the product's order."""
    _check("add_norm_linear", weight, x, *(() if delta is None else (delta,)), norm_weight[None])
    t, d = x.shape
    if weight.shape[1] != d or norm_weight.shape != (d,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_norm_linear: x {tuple(x.shape)}, norm {tuple(norm_weight.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    n = weight.shape[0]
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    s = x if delta is None else torch.empty_like(x)
    if t:
        block_n, block_k = _tiles(n, d)
        _norm_linear_kernel[(triton.cdiv(n, block_n), t)](
            x, x if delta is None else delta, norm_weight, weight, y, s, n, d, eps,
            ADD=delta is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return s, y


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(SiLU(gate) x up) @ weight.T: gate_up [T, 2I] (gate then up), weight [N, I], one dtype,
    contiguous. The same values as `triton_fused.silu_mul` then a projection, up to the product's order."""
    _check("silu_linear", weight, gate_up)
    t, i = gate_up.shape[0], weight.shape[1]
    if gate_up.shape[1] != 2 * i:
        raise ValueError(f"silu_linear: gate_up {tuple(gate_up.shape)} is not [T, 2 x {i}]")
    n = weight.shape[0]
    y = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block_n, block_k = _tiles(n, i)
        _silu_linear_kernel[(triton.cdiv(n, block_n), t)](gate_up, weight, y, n, i, BLOCK_N=block_n, BLOCK_K=block_k)
    return y

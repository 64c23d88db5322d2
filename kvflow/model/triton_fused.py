"""A decoder layer's elementwise passes on CUDA as Triton kernels: the GPU counterpart of
`cpu_kernels`' rms_norm, add_rms_norm, rope_write and silu_mul, with the same signatures and the same
arithmetic, so `LlamaModel` calls whichever set its device has.

Written op by op in PyTorch, these passes are about twenty small kernels per layer (the norm alone is
an add, a cast, a square, a mean, an add, an rsqrt and two multiplies; RoPE a multiply, a negation, a
concatenation and an addcmul; the K/V write two index copies). At decode batch sizes each takes a few
microseconds of a GPU that is otherwise waiting, and each is one more node of a step's CUDA graph.
Here they are four kernels.

Every kernel computes a row (a token) in one program, the same way whatever the number of rows, so
they are batch-invariant by construction. Rounding follows the PyTorch ops they replace: the norm
normalises in float32, rounds to the model's dtype and then scales; RoPE rounds x * cos before it adds
rotate_half(x) * sin (addcmul); SiLU is rounded before the product. Under `TRITON_INTERPRET=1` they
run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch

from kvflow.model.triton_attention import triton

if triton is not None:
    import triton.language as tl

SILU_BLOCK = 1024  # elements of a row of the MLP's intermediate size per program


if triton is not None:

    # The rounding of the norm and of SiLU x up, shared with the projections that take them as their
    # prologue (`triton_fused_linear`), so both round alike by construction.
    @triton.jit
    def rms_inverse(x, D, eps):
        """1 / RMS of a row of D values (x: the row in its dtype, padded with zeros), in float32."""
        xf = x.to(tl.float32)
        return 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)

    @triton.jit
    def rms_scale(x, inv, w):
        """The row normalised in float32 and rounded to x's dtype, then scaled by w and rounded again."""
        normed = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
        return (w.to(tl.float32) * normed).to(x.dtype)

    @triton.jit
    def silu_times(g, u):
        """SiLU(g) rounded to g's dtype, times u, rounded again (g and u in one dtype)."""
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        return (s * u.to(tl.float32)).to(g.dtype)

    @triton.jit
    def _norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, D, eps, ADD: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        x = tl.load(x_ptr + row * D + d, mask=ok, other=0.0)
        if ADD:  # x += residual, rounded to the dtype as PyTorch's `x + delta` is
            x = (x.to(tl.float32) + tl.load(r_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(x_ptr + row * D + d, x, mask=ok)
        w = tl.load(w_ptr + d, mask=ok, other=0.0)
        tl.store(y_ptr + row * D + d, rms_scale(x, rms_inverse(x, D, eps), w), mask=ok)

    @triton.jit
    def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, v_offset,
                           H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HEADS_PAD: tl.constexpr,
                           KV_PAD: tl.constexpr, WRITE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = D // 2
        width = (H + 2 * KVH) * D
        h = tl.arange(0, HEADS_PAD)[:, None]  # the query heads, then the key heads
        i = tl.arange(0, HALF)[None, :]
        ok = h < H + KVH
        row = qkv_ptr + t * width + h * D
        x1 = tl.load(row + i, mask=ok, other=0.0)
        x2 = tl.load(row + HALF + i, mask=ok, other=0.0)
        c1 = tl.load(cos_ptr + t * D + i).to(tl.float32)
        c2 = tl.load(cos_ptr + t * D + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + t * D + i).to(tl.float32)
        s2 = tl.load(sin_ptr + t * D + HALF + i).to(tl.float32)
        a1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2).to(x1.dtype).to(tl.float32)
        o1 = (a1 - x2.to(tl.float32) * s1).to(x1.dtype)
        o2 = (a2 + x1.to(tl.float32) * s2).to(x1.dtype)
        tl.store(row + i, o1, mask=ok)
        tl.store(row + HALF + i, o2, mask=ok)
        if WRITE:
            slot = tl.load(slots_ptr + t)
            if slot >= 0:
                is_k = ok & (h >= H)
                dst = cache_ptr + slot * (KVH * D) + (h - H) * D
                tl.store(dst + i, o1, mask=is_k)
                tl.store(dst + HALF + i, o2, mask=is_k)
                e = tl.arange(0, KV_PAD)
                v = tl.load(qkv_ptr + t * width + (H + KVH) * D + e, mask=e < KVH * D)
                tl.store(cache_ptr + v_offset + slot * (KVH * D) + e, v, mask=e < KVH * D)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < N
        g = tl.load(gu_ptr + row * 2 * N + j, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * 2 * N + N + j, mask=ok, other=0.0)
        tl.store(out_ptr + row * N + j, silu_times(g, u), mask=ok)


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] != weight.shape[0] or not weight.is_contiguous():
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (contiguous) does not match weight {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [T, D] (contiguous) -> a new [T, D], one program per row."""
    _check_rows(x, weight)
    y = torch.empty_like(x)
    if x.shape[0]:
        _norm_kernel[(x.shape[0],)](x, x, weight, y, x.shape[1], eps, ADD=False, BLOCK_D=triton.next_power_of_2(x.shape[1]))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += residual` in place (same shape and dtype, contiguous), then `rms_norm(x)`, in one pass."""
    _check_rows(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError("add_rms_norm: the residual must match x")
    y = torch.empty_like(x)
    if x.shape[0]:
        _norm_kernel[(x.shape[0],)](x, residual, weight, y, x.shape[1], eps, ADD=True,
                                    BLOCK_D=triton.next_power_of_2(x.shape[1]))
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, contiguous) -> SiLU(gate) * up [T, I]."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up [T, 2I] contiguous, got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, SILU_BLOCK))](gate_up, out, n, BLOCK=SILU_BLOCK)
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               kv_layer: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
    """RoPE (rotate_half style) in place on the query and key heads of qkv [T, (H + 2 KVH) * D]
    (contiguous), with cos/sin [T, D] in qkv's dtype; then, if `kv_layer` ([2, blocks, block_size, KVH,
    D], contiguous, qkv's dtype) is given, token t's rotated K and its V go to flat slot `slots[t]`
    (int64; a negative slot writes nothing)."""
    t, d = qkv.shape[0], cos.shape[1]
    if qkv.dim() != 2 or not qkv.is_contiguous() or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or d % 2:
        raise ValueError(f"rope_write: qkv {tuple(qkv.shape)} is not [T, (H + 2 KVH) * D] contiguous")
    if cos.shape != (t, d) or sin.shape != (t, d) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_write: cos and sin must be [T, D], contiguous")
    if (kv_layer is None) != (slots is None):
        raise ValueError("rope_write: the cache and the slots go together")
    if kv_layer is not None and (not kv_layer.is_contiguous() or kv_layer.dtype != qkv.dtype or kv_layer.shape[3:] != (num_kv_heads, d)):
        raise ValueError("rope_write: the cache must be [2, blocks, block_size, KVH, D], contiguous, in qkv's dtype")
    if t == 0:
        return
    write = kv_layer is not None
    _rope_write_kernel[(t,)](qkv, cos, sin, kv_layer if write else qkv, slots if write else qkv,
                             kv_layer.stride(0) if write else 0, H=num_heads, KVH=num_kv_heads, D=d,
                             HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
                             KV_PAD=triton.next_power_of_2(num_kv_heads * d), WRITE=write)

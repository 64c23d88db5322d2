"""A batch-invariant GPU projection in Triton: `y = x @ weight.T`, whose rows never depend on the
other rows of its input.

cuBLAS picks its GEMM by shape (split-K, tile sizes, stream-K), so the same row multiplied in a
batch of 3 and of 64 can round differently. Here every call uses the same tiles and no split over
the inner dimension: each output element is one program's float32 accumulation over K in tiles of
BLOCK_K, in order, whatever the row count or the row's place (rows of a tile share no sum). This is
what `LlamaModel(deterministic=True)` uses on CUDA, with `triton_attention`, so a request's tokens
do not depend on its batch there either.

(The RMS norm, whose PyTorch reduction also splits rows by shape, runs per row in `triton_fused`,
on CUDA always.)

The projection gives up some speed on the shapes cuBLAS would split; under `TRITON_INTERPRET=1` it runs on CPU
tensors for the tests (there, as in `triton_attention`, half-precision dots take float32 copies of
the same values).
"""

from __future__ import annotations

import torch

from kvflow.model.triton_attention import interpreted, triton

if triton is not None:
    import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


if triton is not None:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn < N)[None, :] & (kk < K)[:, None], other=0.0)
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or interpreted())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype; both last dims contiguous."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         UPCAST=x.dtype == torch.float32 or interpreted())
    return y

"""The Triton batch-invariant projection against float64, and its
invariance: a row's result is the same bits alone, in a batch, and in another tile of the batch
(interpreted on the CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kvflow.model import triton_invariant as tl_

pytestmark = pytest.mark.skipif(tl_.triton is None, reason="Triton is not installed")
DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_float64(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 80, generator=g).to(dtype=dtype, device=device)  # K not a multiple of BLOCK_K, M over one tile
    w = torch.randn(96, 80, generator=g).to(dtype=dtype, device=device)
    got = tl_.linear(x, w).double().cpu()
    want = x.double().cpu() @ w.double().cpu().T
    assert torch.allclose(got, want, atol=tol * 10, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_does_not_depend_on_the_others(device, dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 200, generator=g).to(dtype=dtype, device=device)
    batch = torch.randn(70, 200, generator=g).to(dtype=dtype, device=device)
    full = tl_.linear(batch, w)
    for rows in ([5], [0, 1, 2], list(range(60, 70))):  # alone, a few, rows that sat in the second tile
        assert torch.equal(tl_.linear(batch[rows], w), full[rows])
    strided = torch.zeros(70, 400, dtype=dtype, device=device)[:, ::2]  # a non-contiguous input is copied first
    strided.copy_(batch)
    assert torch.equal(tl_.linear(strided, w), full)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="does not match"):
        tl_.linear(torch.zeros(2, 8), torch.zeros(4, 9))

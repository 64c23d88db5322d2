"""The fused Triton passes of a layer (kvflow/model/triton_fused.py) against the PyTorch ops they replace,
every row the same bits alone as in a batch (interpreted on the CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.model import triton_fused as tf
from kvflow.model.llama import rms_norm, rotate_half

pytestmark = pytest.mark.skipif(tf.triton is None, reason="Triton is not installed")
DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else ["cpu"]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]  # bf16: two roundings may land an ulp or two apart


def _rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, except under the interpreter, whose casts to bf16 truncate (compiled ones round to
    nearest even, as PyTorch does): there, within one bf16 ulp."""
    if got.device.type == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def _randn(g, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_norms_match_pytorch_and_do_not_depend_on_other_rows(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = _randn(g, 37, 96, dtype=dtype, device=device, scale=3)  # D not a power of two
    r = _randn(g, 37, 96, dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype=dtype, device=device)
    got = tf.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got.float(), rms_norm(x, w, 1e-5).float(), rtol=tol, atol=tol)
    assert torch.equal(tf.rms_norm(x[30:33].contiguous(), w, 1e-5), got[30:33])
    summed = x.clone()
    normed = tf.add_rms_norm(summed, r, w, 1e-5)
    _rounded_alike(summed, x + r)  # the residual is added in place, rounded as PyTorch's add
    torch.testing.assert_close(normed.float(), rms_norm(x + r, w, 1e-5).float(), rtol=tol, atol=tol)
    alone = x[5:6].clone()
    assert torch.equal(tf.add_rms_norm(alone, r[5:6].contiguous(), w, 1e-5), normed[5:6])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul_matches_pytorch(device, dtype, tol):
    g = torch.Generator().manual_seed(1)
    gu = _randn(g, 9, 2 * 1500, dtype=dtype, device=device, scale=2)  # I over one program's block
    gate, up = gu.chunk(2, dim=-1)
    got = tf.silu_mul(gu)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), rtol=tol, atol=tol)
    assert torch.equal(tf.silu_mul(gu[4:5].contiguous()), got[4:5])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
def test_rope_write_matches_pytorch_and_writes_the_cache(device, dtype, tol, heads, kv_heads):
    g = torch.Generator().manual_seed(2)
    T, D, bs = 7, 32, 4
    qkv = _randn(g, T, (heads + 2 * kv_heads) * D, dtype=dtype, device=device)
    angles = torch.rand(T, D // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype=dtype, device=device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype=dtype, device=device)
    slots = torch.tensor([3, 0, -1, 9, 10, 5, 14], device=device)  # -1: written nowhere
    cache = torch.full((2, 4, bs, kv_heads, D), 7.0, dtype=dtype, device=device)

    qk = qkv[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D)
    want = torch.addcmul(qk * cos[:, None, :], rotate_half(qk), sin[:, None, :])
    v = qkv[:, (heads + kv_heads) * D:].view(T, kv_heads, D).clone()
    got = qkv.clone()
    tf.rope_write(got, cos, sin, heads, kv_heads, cache, slots)
    rotated = got[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D)
    torch.testing.assert_close(rotated.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[:, (heads + kv_heads) * D:].view(T, kv_heads, D), v)  # V untouched
    flat_k, flat_v = cache[0].view(-1, kv_heads, D), cache[1].view(-1, kv_heads, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], rotated[t, heads:]) and torch.equal(flat_v[s], v[t])
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all()
    one = qkv[3:4].clone()  # a row alone: the same bits
    tf.rope_write(one, cos[3:4].contiguous(), sin[3:4].contiguous(), heads, kv_heads)
    assert torch.equal(one, got[3:4])


def test_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="does not match"):
        tf.rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        tf.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        tf.silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="cache and the slots"):
        tf.rope_write(torch.zeros(1, 8 * 4), torch.zeros(1, 8), torch.zeros(1, 8), 2, 1, torch.zeros(2, 1, 1, 1, 8))

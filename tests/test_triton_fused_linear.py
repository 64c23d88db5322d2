"""The fused decode projections (kvflow/model/triton_fused_linear.py) against the separate kernels they
replace (`triton_fused`'s norm or SiLU x up, then `F.linear`), and a model that takes them on decode
steps against one that does not (`decode_fusion`). Interpreted on the CPU; tests/test_cuda.py runs
them on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, tiny_state_dict

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import decode_fusion
from kvflow.model import triton_fused as tf
from kvflow.model import triton_fused_linear as fl
from kvflow.model.batch import ForwardBatch
from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.model.decode_fusion import FusionChoice, Measurement
from kvflow.model.llama import LlamaModel

pytestmark = pytest.mark.skipif(tf.triton is None, reason="Triton is not installed")
DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else ["cpu"]
# Largest difference over the largest magnitude of the separate path's output. float32: only the
# order of the product's sums differs. bf16: the same float32 sum rounded once, but an order's last
# bits can round it to the next value, and the interpreter's casts to bf16 truncate where PyTorch's
# round to nearest: two bf16 ulps, each at most 2^-7 of a value.
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)]
ROWS = [1, 2, 3, 5, 8, 13, 16]
# (rows, inner, out): odd sizes (not multiples of a tile) at every row count; the 135M's shapes at one
# row, and at three where the kernels are compiled (interpreted, such a case takes seconds)
REAL_ROWS = (1, 3) if torch.cuda.is_available() else (1,)
NORM_CASES = [(r, d, n) for r in ROWS for d, n in ((75, 37), (96, 130))] + [(r, 576, 960) for r in REAL_ROWS]
SILU_CASES = [(r, i, n) for r in ROWS for i, n in ((50, 37), (200, 96))] + [(r, 1536, 576) for r in REAL_ROWS]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * float(want.float().abs().max()), err


def _randn(g, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows,d,n", NORM_CASES)
def test_add_norm_linear_matches_the_norm_then_the_projection(device, dtype, tol, rows, d, n):
    g = torch.Generator().manual_seed(rows * 1000 + d)
    x, delta = _randn(g, rows, d, dtype=dtype, device=device, scale=3), _randn(g, rows, d, dtype=dtype, device=device)
    norm = _randn(g, d, dtype=dtype, device=device, scale=0.1) + 1
    weight = _randn(g, n, d, dtype=dtype, device=device, scale=d**-0.5)
    summed = delta.clone()
    want = F.linear(tf.add_rms_norm(summed, x, norm, 1e-5), weight)
    s, got = fl.add_norm_linear(x, delta, norm, weight, 1e-5)
    assert torch.equal(s, summed)  # the residual sum, rounded as add_rms_norm rounds it
    _close(got, want, tol)
    alone_s, alone = fl.add_norm_linear(x[-1:], delta[-1:], norm, weight, 1e-5)  # a row does not depend on the others
    assert torch.equal(alone, got[-1:]) and torch.equal(alone_s, s[-1:])
    same, first = fl.add_norm_linear(x, None, norm, weight, 1e-5)  # no delta: the first layer's plain norm
    assert same is x
    _close(first, F.linear(tf.rms_norm(x, norm, 1e-5), weight), tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("rows,i,n", SILU_CASES)
def test_silu_linear_matches_silu_mul_then_the_projection(device, dtype, tol, rows, i, n):
    g = torch.Generator().manual_seed(rows * 1000 + i)
    gate_up = _randn(g, rows, 2 * i, dtype=dtype, device=device, scale=2)
    weight = _randn(g, n, i, dtype=dtype, device=device, scale=i**-0.5)
    got = fl.silu_linear(gate_up, weight)
    _close(got, F.linear(tf.silu_mul(gate_up), weight), tol)
    assert torch.equal(fl.silu_linear(gate_up[:1], weight), got[:1])


def test_bad_input_is_refused():
    w, x = torch.ones(8, 16, device="cpu"), torch.ones(2, 16, device="cpu")
    with pytest.raises(ValueError, match="do not match"):
        fl.add_norm_linear(x, None, torch.ones(15, device="cpu"), w, 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        fl.add_norm_linear(x, x.double(), torch.ones(16, device="cpu"), w, 1e-5)
    with pytest.raises(ValueError, match="2 x 16"):
        fl.silu_linear(torch.ones(2, 30, device="cpu"), w)
    with pytest.raises(ValueError, match="inner dimension"):
        fl.silu_linear(torch.ones(1, 2 * (fl.TILE + 1), device="cpu"), torch.ones(4, fl.TILE + 1, device="cpu"))
    assert fl.supported(fl.TILE) and not fl.supported(fl.TILE + 1)


def _cuda_like(dtype: torch.dtype, device: str) -> LlamaModel:
    """A tiny model running what a model not `deterministic` runs on CUDA: Triton attention (split decode),
    the `triton_fused` passes, projections by F.linear; no fused projections until a test sets `fusion`."""
    cfg = tiny_config()
    m = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=dtype, device=device, deterministic=False)
    if device == "cpu":
        m.triton_attention, m.fused_ops, m.paged_kernel, m.native_decode, m.cpu_kernels = True, tf, False, False, False
        m.batch_invariant, m.split_decode = False, True
        for lin in [lin for w in m.layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [m._lm_head]:
            lin.invariant, lin.packed = None, None
    return m


ALL = FusionChoice(frozenset(range(1, decode_fusion.FUSED_ROWS[-1] + 1)), why="test")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_decode_steps_through_the_fused_projections_give_the_separate_kernels_logits(monkeypatch, device, dtype, tol):
    """Prompts (never fused), then decode steps of 1, 3 and 5 rows through `DecodeGraphs`' buffers (buckets
    1, 2, 4, 8: padded rows too), fused against separate; bf16's tolerance is over 2 layers and the LM head."""
    m = _cuda_like(dtype, device)
    cfg = m.cfg
    calls = []
    for name in ("add_norm_linear", "silu_linear"):
        real = getattr(fl, name)
        monkeypatch.setattr(fl, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    prompts = [[3, 9, 27], [4, 11, 5, 6, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20], [1, 2], [30, 31, 32, 33]]
    blocks = [[5, 2], [9, 0], [30, 7, 21], [11], [12, 13]]
    cache = KVCache(KVLayout.for_model(cfg, 32, 4, dtype=dtype), device)
    m.fusion = ALL
    m.forward(torch.tensor([t for p in prompts for t in p], device=device),
              ForwardBatch.of([(len(p), len(p), b) for p, b in zip(prompts, blocks)], 4, device), cache)
    assert not calls  # a prompt step keeps the separate kernels
    for n in (1, 3, 5):
        contexts = [(len(p) + 1, b) for p, b in zip(prompts[:n], blocks[:n])]
        tokens = [40 + i for i in range(n)]
        logits = {}
        for fused in (True, False):
            m.fusion = ALL if fused else FusionChoice()
            graphs = DecodeGraphs(m, cache, max_batch=8, max_model_len=64, buckets=(1, 2, 4, 8))  # (captured on CUDA)
            logits[fused] = graphs.run(contexts, tokens=tokens).clone()
            assert ("add_norm_linear" in calls and "silu_linear" in calls) == fused  # (on CUDA, called while capturing)
            calls.clear()
        _close(logits[True], logits[False], tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_check_passes_the_kernels_and_catches_a_wrong_one(monkeypatch, device, dtype):
    """`decode_fusion`'s check before it measures (on the CPU, of the interpreted kernels)."""
    layer = _cuda_like(dtype, device).layers[0]
    assert decode_fusion._agree(layer, 1, 1e-5) and decode_fusion._agree(layer, 16, 1e-5)
    real = fl.silu_linear
    monkeypatch.setattr(fl, "silu_linear", lambda gu, w: real(gu, w) * 1.1)
    assert not decode_fusion._agree(layer, 3, 1e-5)


def test_the_choice_takes_the_measured_row_counts_and_the_override(monkeypatch):
    measured = [Measurement(1, 10.0, 8.0), Measurement(2, 10.0, 9.0), Measurement(4, 10.0, 11.0),
                Measurement(8, 10.0, 9.9), Measurement(16, 10.0, 10.0)]
    assert decode_fusion.rows_chosen(measured) == {1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15}  # 3 as 2, 5-7 as 4, 16: a tie
    layers = _cuda_like(torch.float32, "cpu").layers
    monkeypatch.setenv("KVFLOW_FUSED_PROJECTIONS", "1")
    assert decode_fusion.choose(layers, 1e-5).rows == frozenset(range(1, 17))
    monkeypatch.setenv("KVFLOW_FUSED_PROJECTIONS", "0")
    assert decode_fusion.choose(layers, 1e-5).rows == frozenset()
    monkeypatch.setenv("KVFLOW_FUSED_PROJECTIONS", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        decode_fusion.choose(layers, 1e-5)


def test_a_model_off_cuda_never_fuses():
    cfg = tiny_config()
    for deterministic in (True, False):
        m = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), deterministic=deterministic)
        assert not m.fusion.rows and m.fusion.why.startswith("off")

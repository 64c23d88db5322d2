"""The fused CPU kernels against the PyTorch formulas they replace, and the model with them on vs off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import cpu_kernels
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.llama import LlamaModel, rms_norm, rotate_half

from conftest import tiny_config, tiny_state_dict

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")

DTYPES = pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
ROWS = pytest.mark.parametrize("rows", [1, 3, 16, 300])
WIDTHS = pytest.mark.parametrize("width", [64, 576, 37])  # 37: not a multiple of the vector width


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = ((got.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()
    assert err <= tol, err


@DTYPES
@ROWS
@WIDTHS
def test_rms_norm_and_add_rms_norm(dtype, tol, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x, res = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
    w = (1 + torch.randn(width, generator=g) / 4).to(dtype)
    _close(cpu_kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), tol)
    total = x + res
    out = cpu_kernels.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(x, total)  # the sum is written back in x's dtype
    _close(out, rms_norm(total, w, 1e-5), tol)


@DTYPES
@ROWS
@WIDTHS
def test_silu_mul(dtype, tol, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    gu = (torch.randn(rows, 2 * width, generator=g) * 3).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(cpu_kernels.silu_mul(gu), F.silu(gate) * up, tol)


@DTYPES
@ROWS
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 16), ((2, 1), 6)], ids=["smollm", "tiny", "odd"])
def test_rope_and_kv_write(dtype, tol, rows, heads, head_dim):
    H, KVH = heads
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (H + 2 * KVH) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (rows,), generator=g).float()
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qk = qkv[:, : (H + KVH) * head_dim].view(rows, H + KVH, head_dim)
    ref_qk = torch.addcmul(qk * cos[:, None], rotate_half(qk), sin[:, None])
    ref_v = qkv[:, (H + KVH) * head_dim :].view(rows, KVH, head_dim).clone()
    block_size = 4
    cache = torch.zeros(2, (rows + 3) // block_size + 2, block_size, KVH, head_dim, dtype=dtype)
    slots = torch.randperm(cache.shape[1] * block_size, generator=g)[:rows]
    cpu_kernels.rope_write(qkv, cos, sin, H, KVH, cache, slots)
    _close(qkv[:, : (H + KVH) * head_dim].view(rows, H + KVH, head_dim), ref_qk, tol)
    flat = cache.view(2, -1, KVH, head_dim)
    assert torch.equal(flat[0, slots], qkv[:, H * head_dim : (H + KVH) * head_dim].view(rows, KVH, head_dim))
    assert torch.equal(flat[1, slots], ref_v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("out,width", [(48, 64), (7, 576), (33, 37)], ids=["64", "576", "tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_skinny_linear(rows, out, width, dtype):
    # float32 accumulation of exact products, one rounding to the dtype at the end: against float64,
    # only the final rounding (half an ulp of the dtype, 2^-9 for bf16) and fp32 summation remain
    g = torch.Generator().manual_seed(rows * 100 + width)
    x, w = torch.randn(rows, width, generator=g).to(dtype), torch.randn(out, width, generator=g).to(dtype)
    ref = (x.double() @ w.double().t()).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    _close(cpu_kernels.skinny_linear(x, w), ref, tol)


@DTYPES
def test_forced_small_row_kernel_gives_the_prepacked_logits(monkeypatch, dtype, tol):
    cfg = tiny_config(num_layers=2)
    sd = tiny_state_dict(cfg, 3)
    ids = [3, 17, 5, 9, 11, 2, 30, 4]
    logits = {}
    for path in ("kernel", "prepacked"):
        monkeypatch.setenv("KVFLOW_LINEAR_SMALL_ROWS", path)
        model = LlamaModel.from_state_dict(cfg, sd, dtype=dtype, deterministic=False)  # the fast paths
        if model.layers[0].qkv.packed is None:
            pytest.skip(f"no oneDNN prepacked linear for {dtype} on this CPU")
        assert model.layers[0].qkv.small[1] == path
        kv = KVCache(KVLayout.for_model(cfg, 64, 4, dtype=dtype))
        b = ForwardBatch.build([SeqSlice(0, len(ids), len(ids), (0, 1))], 4)
        model.forward(torch.tensor(ids), b, kv)
        # a decode step of one sequence: every projection takes 1 row
        b = ForwardBatch.build([SeqSlice(0, 1, len(ids) + 1, (0, 1, 2))], 4)
        logits[path] = model.forward(torch.tensor([7]), b, kv)
    _close(logits["kernel"], logits["prepacked"], 1e-5 if dtype == torch.float32 else tol * 5)


def test_kernels_reject_bad_inputs():
    with pytest.raises(RuntimeError):
        cpu_kernels.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError):
        cpu_kernels.silu_mul(torch.randn(4, 9))
    with pytest.raises(RuntimeError):
        cpu_kernels.skinny_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError):
        cpu_kernels.skinny_linear(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(RuntimeError):
        cpu_kernels.rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 1e-5)


@DTYPES
def test_model_with_kernels_equals_pytorch_path(dtype, tol, monkeypatch):
    # the same prefill + decode steps with the kernels (as built) and with KVFLOW_CPU_KERNELS=0
    cfg = tiny_config(num_layers=3)
    outs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("KVFLOW_CPU_KERNELS", switch)
        model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg, 2), dtype=dtype)
        assert model.cpu_kernels == (switch == "1")
        kv = KVCache(KVLayout.for_model(cfg, 64, 4, dtype=dtype))
        ids = [3, 17, 5, 9, 11, 2, 30]
        b = ForwardBatch.build([SeqSlice(0, len(ids), len(ids), (0, 1))], 4)
        steps = [model.forward(torch.tensor(ids), b, kv)]
        for n in range(len(ids) + 1, len(ids) + 4):
            b = ForwardBatch.build([SeqSlice(0, 1, n, (0, 1, 2))], 4)
            steps.append(model.forward(torch.tensor([n % 31]), b, kv))
        outs.append(torch.stack(steps))
    _close(outs[0], outs[1], tol * 10 if dtype != torch.float32 else 1e-5)


@DTYPES
@pytest.mark.parametrize("path", cpu_kernels.DECODE_PATHS)
def test_native_decode_step_is_bitwise_the_op_by_op_one(dtype, tol, path, monkeypatch):
    # decode_layers runs a decode step's layers in one C++ call; it must be exactly the per-op
    # Python path (same kernels, same projections, same order), for every projection path, at
    # batch 1 and 5 (5: padded/skinny choices differ by row count), on a 3-layer stage of a
    # 4-layer model (layer_start > 0: global KV layer indices)
    from kvflow.model.linear import small_paths

    if path == "fixed" and path not in small_paths(dtype):
        pytest.skip(f"invariant_linear runs on neither AMX nor AVX512-BF16 for {dtype} on this CPU")
    monkeypatch.setenv("KVFLOW_LINEAR_SMALL_ROWS", path)
    cfg = tiny_config(num_layers=4)
    sd = tiny_state_dict(cfg, 5)
    model = LlamaModel.from_state_dict(cfg, sd, dtype=dtype, layer_range=(1, 4), deterministic=False)
    if path in ("prepacked", "padded") and model.layers[0].qkv.packed is None:
        pytest.skip(f"no oneDNN prepacked linear for {dtype} on this CPU")
    assert model.native_decode
    assert (model.layers[0].qkv.invariant is not None) == (path == "fixed")  # the unchosen copy is freed
    calls = []
    native_call = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda *a: calls.append(a) or native_call(*a))
    for batch in (1, 5):
        kv = KVCache(KVLayout.for_model(cfg, 64, 4, dtype=dtype, layer_range=(1, 4)))
        kv.data.normal_(generator=torch.Generator().manual_seed(batch))
        fb = ForwardBatch.build([SeqSlice(i, 1, 8 + i, tuple(range(3 * i, 3 * i + 3))) for i in range(batch)], 4)
        hidden = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
        out = {}
        for native in (False, True):
            model.native_decode = native
            cache = KVCache(kv.layout)
            cache.data.copy_(kv.data)
            out[native] = (model.run_layers(hidden.clone(), fb, cache), cache.data)
        assert len(calls) == batch // 5 + 1  # the native step ran (once per batch size)
        assert torch.equal(out[True][0], out[False][0])
        assert torch.equal(out[True][1], out[False][1])  # the same K/V written
    model.paged_kernel = False  # the gather path (benchmarks/engine.py compares the two): no native loop
    model.run_layers(hidden.clone(), fb, KVCache(kv.layout))
    assert len(calls) == 2


def _runs_while_called(call) -> bool:
    """Whether another Python thread gets to run while `call()` runs. The switch interval is set so
    long that the calling thread never hands the GIL over by itself: the other thread (ready and
    waiting for the GIL) can only run inside a call that releases it. Up to 2000 calls, until it has
    (a call of a few ms: the waiting thread needs time to wake up and take the GIL)."""
    import sys
    import threading

    go, ran = threading.Event(), []
    t = threading.Thread(target=lambda: (go.wait(), ran.append(True)))
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # before the thread exists: its every wait for the GIL is that long
    t.start()
    try:
        go.set()
        for _ in range(2000):
            call()
            if ran:
                break
        return bool(ran)
    finally:
        sys.setswitchinterval(old)
        t.join()


def test_kernels_release_the_gil():
    """A decode step in the native loop takes 10-25 ms; holding the GIL meanwhile froze the serving
    event loop (timers, new requests, streamed tokens) for the whole step. The results are kept: freeing
    a tensor can hand the GIL over by itself, and would let the other thread run without the kernel."""
    kv = torch.randn(2, 64, 16, 3, 64)
    q, table, ctx = torch.randn(4, 9, 64), torch.arange(64).view(4, 16), torch.tensor([256, 250, 17, 100])
    kept: list[torch.Tensor] = []
    assert _runs_while_called(lambda: kept.append(cpu_kernels.paged_decode_attention(q, kv, table, ctx, 0.125)))

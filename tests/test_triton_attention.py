"""The Triton paged-attention kernel against plain PyTorch attention, and its batch invariance.

On a machine without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before anything imports Triton), so CI checks its indexing, masking and online softmax
on every push; with a GPU the same tests run compiled on CUDA (`pytest -m cuda` runs only those).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.model import triton_attention as ta

pytestmark = pytest.mark.skipif(ta.triton is None, reason="Triton is not installed")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _device_param(dev: str):
    return pytest.param(dev, marks=pytest.mark.cuda) if dev == "cuda" else dev


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype=dtype, device=device)


def layout(seqs, block_size, num_blocks, seed=0):
    """(query_len, context_len) per sequence -> block ids per sequence, drawn without reuse in a shuffled
    order (a real pool's blocks are scattered), and the padded block table."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for _, ctx in seqs:
        n = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(n)])
    width = max(len(t) for t in tables)
    return tables, [t + [t[0]] * (width - len(t)) for t in tables]


def run_kernel(q, cache, seqs, tables_padded, device):
    starts, s = [], 0
    for ql, _ in seqs:
        starts.append(s)
        s += ql
    long = dict(dtype=torch.long, device=device)
    out = torch.zeros_like(q)
    return ta.paged_attention(q, cache, torch.tensor(tables_padded, **long), torch.tensor(starts, **long),
                              torch.tensor([ql for ql, _ in seqs], **long), torch.tensor([c for _, c in seqs], **long),
                              max(ql for ql, _ in seqs), 0.125, out)


def reference(q, cache, seqs, tables, block_size):
    """Per sequence: gather its keys, causal mask by position, softmax in float64."""
    out, row = torch.zeros_like(q, dtype=torch.float64), 0
    heads, kv_heads = q.shape[1], cache.shape[3]
    for (ql, ctx), blocks in zip(seqs, tables):
        idx = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx)], device=cache.device)
        k = cache[0].reshape(-1, kv_heads, cache.shape[-1])[idx].double().repeat_interleave(heads // kv_heads, 1)
        v = cache[1].reshape(-1, kv_heads, cache.shape[-1])[idx].double().repeat_interleave(heads // kv_heads, 1)
        qs = q[row:row + ql].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * 0.125
        pos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
        out[row:row + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        row += ql
    return out


# decode rows, a whole prompt, a chunk after cached context, a context that is not a multiple of the
# key tile, a query longer than one query tile, and a one-token context
MIXED = [(1, 37), (20, 20), (7, 70), (1, 1), (18, 50), (1, 64)]


@pytest.mark.parametrize("device", [_device_param(d) for d in DEVICES])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("block_size,heads,kv_heads", [(16, 4, 2), (8, 9, 3), (128, 4, 4)])
def test_matches_reference(device, dtype, tol, block_size, heads, kv_heads):
    seqs, head_dim = MIXED, 16
    num_blocks = sum(-(-c // block_size) for _, c in seqs) + 3
    tables, padded = layout(seqs, block_size, num_blocks)
    cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(ql for ql, _ in seqs), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=device)
    got = run_kernel(q, cache, seqs, padded, device).cpu().double()
    want = reference(q.cpu(), cache.cpu(), seqs, tables, block_size)
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


@pytest.mark.parametrize("device", [_device_param(d) for d in DEVICES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch_or_the_chunking(device, dtype):
    """One sequence's rows bitwise equal alone, beside other sequences, and when its prompt is split
    into two chunks (the second chunk attends to the first one's cached K/V)."""
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 16
    ctx = 45
    others = [(1, 90), (30, 30), (1, 3)]
    num_blocks = 40
    tables, _ = layout(others + [(ctx, ctx)], block_size, num_blocks)
    mine = tables[-1]
    cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    g = torch.Generator().manual_seed(2)
    q_mine = torch.randn(ctx, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    q_others = torch.randn(sum(ql for ql, _ in others), heads, head_dim, generator=g).to(dtype=dtype, device=device)

    def pad(rows):
        w = max(len(r) for r in rows)
        return [r + [r[0]] * (w - len(r)) for r in rows]

    alone = run_kernel(q_mine, cache, [(ctx, ctx)], [mine], device)
    batched = run_kernel(torch.cat([q_others, q_mine]), cache, others + [(ctx, ctx)], pad(tables), device)[-ctx:]
    assert torch.equal(alone, batched)
    split = 19  # first chunk 19 rows, then 26 rows after 19 cached
    first = run_kernel(q_mine[:split], cache, [(split, split)], [mine], device)
    second = run_kernel(q_mine[split:], cache, [(ctx - split, ctx)], [mine], device)
    assert torch.equal(torch.cat([first, second]), alone)
    # the last row as a decode row (one query token over the whole context), beside others
    decode = run_kernel(torch.cat([q_others, q_mine[-1:]]), cache, others + [(1, ctx)], pad(tables), device)[-1:]
    assert torch.equal(decode, alone[-1:])


def test_rejects_shapes_it_cannot_run():
    cache = torch.zeros(2, 4, 16, 2, 12)
    q = torch.zeros(3, 4, 12)
    long = dict(dtype=torch.long)
    with pytest.raises(ValueError, match="power of two"):
        ta.paged_attention(q, cache, torch.zeros(1, 1, **long), torch.zeros(1, **long), torch.ones(1, **long),
                           torch.ones(1, **long), 1, 1.0, torch.zeros_like(q))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted on CPU tensors; with a GPU, tests/test_cuda.py runs the model on them")
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_the_model_on_the_kernel_gives_the_tokens_of_its_cpu_path(monkeypatch, invariant):
    """Greedy tokens of an engine whose model attends with the Triton kernel (as on CUDA) equal the
    default path's, with chunked prompts, decode rows and prompt chunks in one step, and cached context."""
    from conftest import run_to_completion, tiny_engine

    from kvflow.sched.sampling import SamplingParams

    calls = {"prefill": 0, "decode": 0}

    def counted(*args):
        calls["decode" if args[6] == 1 else "prefill"] += 1
        return kernel(*args)

    kernel, split = ta.paged_attention, ta.paged_decode
    monkeypatch.setattr(ta, "paged_attention", counted)
    monkeypatch.setattr(ta, "paged_decode", lambda *a, **k: calls.__setitem__("split", calls.get("split", 0) + 1) or split(*a, **k))

    def tokens(triton_path: bool):
        eng = tiny_engine(max_num_batched_tokens=12, prefill_chunk_size=8)
        if triton_path:
            m = eng.model
            m.triton_attention, m.paged_kernel, m.native_decode = True, False, False
            m.batch_invariant, m.split_decode = invariant, not invariant  # (fast: the split kernel, as on CUDA by default)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        ids = [eng.add_request([5 + i, 17, 3, 40 + i] * (3 + i), params).request_id for i in range(3)]
        done = run_to_completion(eng)
        return [done[r].token_ids for r in ids]

    assert tokens(True) == tokens(False)
    assert calls["prefill"] > 0 and (calls["decode"] > 0 if invariant else calls["split"] > 0)  # every kind of row went through a kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted on CPU tensors; with a GPU, tests/test_cuda.py runs the model on them")
def test_the_deterministic_model_on_the_triton_kernels_gives_the_tokens_of_its_cpu_path(monkeypatch):
    """Every kernel a deterministic model runs on CUDA (attention, projections, the fused norms, RoPE
    + K/V write and SiLU), interpreted: float32 greedy tokens equal the CPU path's."""
    from conftest import run_to_completion, tiny_engine

    from kvflow.model import triton_fused, triton_invariant
    from kvflow.sched.sampling import SamplingParams

    def tokens(triton_path: bool):
        eng = tiny_engine(max_num_batched_tokens=12, prefill_chunk_size=8)
        if triton_path:
            m = eng.model
            m.triton_attention, m.fused_ops, m.paged_kernel, m.native_decode, m.cpu_kernels = True, triton_fused, False, False, False
            for lin in [lin for w in m.layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [m._lm_head]:
                lin.invariant, lin.packed, lin.triton = None, None, True
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        ids = [eng.add_request([5 + i, 17, 3, 40 + i] * (2 + i), params).request_id for i in range(2)]
        done = run_to_completion(eng)
        return [done[r].token_ids for r in ids]

    calls = []
    for module, name in [(triton_invariant, "linear")] + [(triton_fused, n) for n in ("rms_norm", "add_rms_norm", "rope_write", "silu_mul")]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    assert tokens(True) == tokens(False)
    assert {"linear", "rms_norm", "add_rms_norm", "rope_write", "silu_mul"} <= set(calls)


@pytest.mark.parametrize("device", [_device_param(d) for d in DEVICES])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
@pytest.mark.parametrize("parts", [None, 1, 3, 16])
def test_split_decode_matches_float64(device, dtype, tol, heads, kv_heads, parts):
    """`paged_decode` (each context cut into slices, merged): decode rows of contexts shorter than one
    slice per part, not a multiple of the key tile or the block, and long ones, against float64; rows
    of `out` that are not decode rows are left alone."""
    bs, head_dim = 16, 32
    seqs = [(1, 1), (1, 37), (1, 300), (1, 64), (1, 129)]
    cache = make_cache(64, bs, kv_heads, head_dim, dtype, device)
    tables, padded = layout(seqs, bs, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(seqs) + 2, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    rows = [0, 2, 3, 5, 6]  # decode rows among other rows (a mixed step's)
    long = dict(dtype=torch.long, device=device)
    out = torch.full_like(q, 7.0)
    ta.paged_decode(q, cache, torch.tensor(padded, **long), torch.tensor(rows, **long),
                    torch.tensor([c for _, c in seqs], **long), 0.125, out, parts=parts)
    want = reference(q[rows], cache, seqs, tables, bs)
    torch.testing.assert_close(out[rows].double().cpu(), want.cpu(), rtol=tol, atol=tol)
    assert (out[[1, 4]] == 7.0).all()


def test_split_decode_parts_follow_the_batch_shape():
    cpu = torch.device("cpu")
    assert ta.decode_parts(1, 8, cpu) == ta.MAX_DECODE_PARTS  # one sequence: as many slices as allowed
    assert ta.decode_parts(64, 8, cpu) == 1  # the batch fills the device: no split
    assert 1 < ta.decode_parts(8, 8, cpu) < ta.MAX_DECODE_PARTS


def test_the_split_kernel_is_checked_before_a_model_uses_it():
    """`split_decode_works` runs it against the per-head kernel once per device (here interpreted)."""
    assert ta.split_decode_works(torch.device(DEVICES[0]))

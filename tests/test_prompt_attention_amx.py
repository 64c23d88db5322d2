"""The AMX prompt-attention kernel (`cpu_kernels.paged_prefill_attention_fast`) against a float32
reference, the chooser that sends long chunks to it, and the model's fast path through it."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import cpu_kernels, prompt_attention
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.llama import LlamaModel

from conftest import tiny_config, tiny_state_dict

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")

# bf16 inputs, float32 reference: the kernel rounds P to bf16 before P V and its output to bf16
# (half an ulp of values below 2: 2^-8); outputs are averages of N(0, 1) values, |out| < ~3.
TOL = 2.5e-2


def _amx(D=64, H=9, KVH=3):
    if not cpu_kernels.fast_prefill_available(torch.bfloat16, D, H, KVH):
        pytest.skip("no AMX here (CPU, kernel build or OS permission): the fast prompt kernel does not run")


def _case(seqs, H, KVH, D, BS, seed=0, gap=0):
    """Random bf16 q and cache for sequences of (query_len, context_len), blocks shuffled over the
    cache; `gap` rows of no sequence between consecutive chunks and after the last."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-c // BS) for _, c in seqs) + 2
    kv = torch.randn(2, nblocks, BS, KVH, D, generator=g).bfloat16()
    free = torch.randperm(nblocks, generator=g).tolist()
    width = max(-(-c // BS) for _, c in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.long)
    starts, row = [], 0
    for i, (ql, c) in enumerate(seqs):
        ids = [free.pop() for _ in range(-(-c // BS))]
        table[i] = torch.tensor(ids + [ids[0]] * (width - len(ids)))
        starts.append(row)
        row += ql + gap
    q = torch.randn(row, H, D, generator=g).bfloat16()
    meta = [torch.tensor(x, dtype=torch.long) for x in (starts, [s[0] for s in seqs], [s[1] for s in seqs])]
    return q, kv, table, *meta


def _reference(q, kv, table, starts, qlens, ctxs, scale):
    """float32 attention of each chunk over its cached keys, causal: -> {row: [H, D]}."""
    H, D, KVH, BS = q.shape[1], q.shape[2], kv.shape[3], kv.shape[2]
    out = {}
    for s in range(len(starts)):
        c, n, st = int(ctxs[s]), int(qlens[s]), int(starts[s])
        blocks = table[s, : -(-c // BS)]
        k = kv[0][blocks].reshape(-1, KVH, D)[:c].float().repeat_interleave(H // KVH, 1)
        v = kv[1][blocks].reshape(-1, KVH, D)[:c].float().repeat_interleave(H // KVH, 1)
        scores = torch.einsum("thd,khd->htk", q[st:st + n].float(), k) * scale
        visible = torch.arange(c)[None, :] <= torch.arange(n)[:, None] + c - n
        o = torch.einsum("htk,khd->thd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)
        out.update({st + i: o[i] for i in range(n)})
    return out


def _check(seqs, H=9, KVH=3, D=64, BS=128, gap=0, seed=0):
    _amx(D, H, KVH)
    q, kv, table, starts, qlens, ctxs = _case(seqs, H, KVH, D, BS, seed, gap)
    scale = D**-0.5
    sentinel = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    got = cpu_kernels.paged_prefill_attention_fast(q, kv, table, starts, qlens, ctxs, scale, sentinel)
    assert got is sentinel
    ref = _reference(q, kv, table, starts, qlens, ctxs, scale)
    rows = torch.tensor(sorted(ref))
    err = (got[rows].float() - torch.stack([ref[r] for r in sorted(ref)])).abs().max().item()
    assert err < TOL, err
    untouched = [r for r in range(q.shape[0]) if r not in ref]
    assert all(bool((got[r] == 7.0).all()) for r in untouched)  # rows of no sequence keep their values
    # the new-tensor form computes the same
    again = cpu_kernels.paged_prefill_attention_fast(q, kv, table, starts, qlens, ctxs, scale)
    assert torch.equal(again[rows], got[rows])


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 128, 300, 1024])
@pytest.mark.parametrize("block", [16, 128])
def test_whole_prompts(n, block):
    _check([(n, n)], BS=block)


@pytest.mark.parametrize("qlen,ctx", [(1, 40), (17, 50), (64, 200), (512, 1024), (33, 129)])
def test_chunks_after_cached_context(qlen, ctx):
    _check([(qlen, ctx)], BS=16)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (16, 2)], ids=["g1", "g3", "g4", "g8"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_groups_and_head_dims(heads, kv_heads, head_dim):
    _check([(70, 70), (20, 90)], H=heads, KVH=kv_heads, D=head_dim, BS=16, seed=heads * head_dim)


def test_several_sequences_in_one_call_leave_other_rows_untouched():
    _check([(300, 300), (5, 5), (48, 100), (1, 7), (129, 400)], BS=16, gap=3, seed=5)


def test_rejects_what_it_does_not_take():
    _amx()
    q, kv, table, starts, qlens, ctxs = _case([(8, 8)], 9, 3, 64, 16)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.paged_prefill_attention_fast(q.float(), kv.float(), table, starts, qlens, ctxs, 0.125)
    with pytest.raises(RuntimeError, match="too few blocks"):
        cpu_kernels.paged_prefill_attention_fast(q, kv, table, starts, qlens, ctxs + 16, 0.125)


def test_chooser_bands(monkeypatch):
    """The measured winners per length become one band of the AMX kernel and one of SDPA, from the
    longest length down; an exception to a band ends it."""
    monkeypatch.delenv("KVFLOW_PROMPT_ATTENTION", raising=False)
    monkeypatch.setattr(prompt_attention, "_CHOSEN", {})
    lens = (128, 256, 512, 1024)
    monkeypatch.setattr(prompt_attention, "MEASURED_LENS", lens)
    cases = [
        (["paged", "amx", "amx", "amx"], (256, None)),
        (["paged", "amx", "amx", "sdpa"], (256, 1024)),
        (["amx", "paged", "amx", "sdpa"], (512, 1024)),
        (["sdpa", "sdpa", "sdpa", "sdpa"], (None, 128)),
        (["amx", "amx", "sdpa", "amx"], (1024, None)),
        (["paged", "paged", "sdpa", "paged"], (None, None)),
    ]
    for i, (winners, want) in enumerate(cases):
        script = dict(zip(lens, winners))
        monkeypatch.setattr(prompt_attention, "_fastest", lambda n, *a: script[n])
        assert prompt_attention.choose_prompt_paths(9, 3, 64 + 32 * i, torch.bfloat16) == want, winners


def test_forced_paths(monkeypatch):
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "sdpa")
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.bfloat16) == (None, 2)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "paged")
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.bfloat16) == (None, None)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "amx")
    here = cpu_kernels.fast_prefill_available(torch.bfloat16, 64, 9, 3)
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.bfloat16) == ((2 if here else None), None)
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.float32) == (None, None)  # bf16 only


def test_prompt_bands():
    seqs = [SeqSlice(0, 12, 12, (0, 1, 2)), SeqSlice(12, 5, 5, (3, 4)), SeqSlice(17, 1, 9, (5, 6, 7)),
            SeqSlice(18, 4, 10, (8, 9, 10))]
    batch = ForwardBatch.build(seqs, 4)
    mid, long, short = batch.prompt_bands(5, 8)
    assert long == [0] and mid[2].tolist() == [5] and mid[1].tolist() == [12] and short[3].tolist() == [10]
    mid, long, short = batch.prompt_bands(2, None)
    assert long == [] and short is None and mid[0] is batch.prefill_block_table
    assert batch.prompt_bands(5, 8) is batch.prompt_bands(5, 8)


def _model(deterministic: bool) -> LlamaModel:
    cfg = tiny_config(num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
    return LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=torch.bfloat16, deterministic=deterministic)


def test_model_fast_path_takes_it_in_one_call_and_agrees_with_the_paged_kernel(monkeypatch):
    _amx(64, 6, 2)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "paged")
    model = _model(deterministic=False)
    cfg = model.cfg
    calls = []
    real = cpu_kernels.paged_prefill_attention_fast
    monkeypatch.setattr(cpu_kernels, "paged_prefill_attention_fast", lambda q, kv, t, *a: calls.append(t.shape[0]) or real(q, kv, t, *a))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (200, 37, 90)]

    def run(amx_from):
        model.amx_from = amx_from
        kv = KVCache(KVLayout.for_model(cfg, 64, 16, dtype=torch.bfloat16))
        first = ForwardBatch.build([SeqSlice(0, 60, 60, (40, 41, 42, 43))], 16)  # the third prompt's first 60 cached
        model.forward(torch.tensor(prompts[2][:60]), first, kv)
        calls.clear()
        seqs = [SeqSlice(0, 200, 200, tuple(range(13))), SeqSlice(200, 37, 37, (13, 14, 15)),
                SeqSlice(237, 30, 90, (40, 41, 42, 43, 44, 45))]
        logits = model.forward(torch.tensor(prompts[0] + prompts[1] + prompts[2][60:]), ForwardBatch.build(seqs, 16), kv)
        return logits.float(), list(calls)

    paged, none = run(None)
    assert none == []
    fast, taken = run(32)
    assert taken == [2] * cfg.num_layers  # the 200- and 37-token chunks together, once per layer; the 30 paged
    assert ((fast - paged).abs() / (1 + paged.abs())).max().item() < 5e-2  # (bf16 logits: an ulp at 4 is 0.03)
    top2 = paged.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # greedy tokens agree where the paged path's choice is not a near tie
    assert clear.any() and torch.equal(fast.argmax(-1)[clear], paged.argmax(-1)[clear])


def test_deterministic_model_never_takes_it(monkeypatch):
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "amx")
    monkeypatch.setattr(cpu_kernels, "paged_prefill_attention_fast", lambda *a: pytest.fail("fast kernel called"))
    model = _model(deterministic=True)
    assert model.amx_from is None and model.sdpa_from is None
    seqs = [SeqSlice(0, 100, 100, tuple(range(7)))]
    kv = KVCache(KVLayout.for_model(model.cfg, 16, 16, dtype=torch.bfloat16))
    model.forward(torch.arange(3, 103) % model.cfg.vocab_size, ForwardBatch.build(seqs, 16), kv)


def test_threads_split_items_not_rows():
    """An item's rows are computed by one thread: the result is the same on 1 and 2 threads."""
    _amx()
    q, kv, table, starts, qlens, ctxs = _case([(300, 300), (64, 200)], 9, 3, 64, 16, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_prefill_attention_fast(q, kv, table, starts, qlens, ctxs, 0.125)
        torch.set_num_threads(2)
        two = cpu_kernels.paged_prefill_attention_fast(q, kv, table, starts, qlens, ctxs, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[:364], two[:364])


def test_without_amx_the_chooser_measures_paged_against_sdpa_only(monkeypatch):
    """A CPU without AMX (an EPYC with AVX512-BF16): today's choice, never the AMX kernel."""
    monkeypatch.delenv("KVFLOW_PROMPT_ATTENTION", raising=False)
    monkeypatch.setattr(prompt_attention, "_CHOSEN", {})
    monkeypatch.setattr(cpu_kernels, "fast_prefill_available", lambda *a: False)
    seen = []
    monkeypatch.setattr(prompt_attention, "_fastest", lambda n, *a: seen.append(a[-1]) or "paged")
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.bfloat16) == (None, None)
    assert seen == [False] * len(prompt_attention.MEASURED_LENS)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "amx")
    assert prompt_attention.choose_prompt_paths(9, 3, 64, torch.bfloat16) == (None, None)

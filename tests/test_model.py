"""Forward pass over the paged cache: vs transformers, chunked == one-shot, split layers == all layers, batching."""

from __future__ import annotations

import pytest
import torch

from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.config import RopeScaling

from kvflow.kv.cache import KVCache, KVLayout

from conftest import tiny_cache, tiny_config, tiny_model, tiny_state_dict


def _prefill(model, kv, ids, blocks, block_size=4, past=0, hook=None):
    b = ForwardBatch.build([SeqSlice(0, len(ids), past + len(ids), tuple(blocks))], block_size)
    return model.forward(torch.tensor(ids), b, kv, hook)


def _hf_model(cfg, sd):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf())).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize(
    "rope",
    [RopeScaling(), RopeScaling(kind="linear", factor=2.0), RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=64)],
    ids=["default", "linear", "llama3"],
)
def test_matches_transformers_prefill_and_decode(rope):
    cfg = tiny_config(num_layers=3, rope_scaling=rope)
    sd = tiny_state_dict(cfg, seed=1)
    hf = _hf_model(cfg, sd)
    model = tiny_model(cfg, seed=1)
    kv = tiny_cache(cfg)
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(20))
    ours = _prefill(model, kv, ids, blocks)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ours[0] - ref).abs().max().item() < 1e-4
    seq = list(ids)
    for step in range(5):
        nxt = int(ours[0].argmax())
        seq.append(nxt)
        ours = _prefill(model, kv, [nxt], blocks, past=len(seq) - 1)
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1]
        assert (ours[0] - ref).abs().max().item() < 1e-4, f"decode step {step}"


def test_chunked_prefill_equals_one_shot(cfg):
    model = tiny_model(cfg)
    ids = list(range(3, 3 + 30))
    kv1, kv2 = tiny_cache(cfg), tiny_cache(cfg)
    blocks = [5, 2, 9, 11, 0, 7, 3, 8]  # non-contiguous on purpose
    one = _prefill(model, kv1, ids, blocks)
    pos = 0
    for chunk in (7, 1, 13, 9):
        out = _prefill(model, kv2, ids[pos : pos + chunk], blocks, past=pos)
        pos += chunk
    assert torch.allclose(one, out, atol=1e-5)
    for layer in range(cfg.num_layers):
        k1, v1 = kv1.read(layer, blocks, 30)
        k2, v2 = kv2.read(layer, blocks, 30)
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_layer_ranges_compose(split):
    cfg = tiny_config(num_layers=4)
    sd = tiny_state_dict(cfg)
    from kvflow.model.llama import LlamaModel

    full = LlamaModel.from_state_dict(cfg, sd)
    first = LlamaModel.from_state_dict(cfg, sd, layer_range=(0, split))
    second = LlamaModel.from_state_dict(cfg, sd, layer_range=(split, 4))
    assert first.is_first and not first.is_last and second.is_last and not second.is_first
    ids = torch.tensor([4, 8, 15, 16, 23, 42, 7])
    blocks = (0, 1)
    b = ForwardBatch.build([SeqSlice(0, 7, 7, blocks)], 4)
    ref = full.forward(ids, b, tiny_cache(cfg))
    kv_a = tiny_cache(cfg, layer_range=(0, split))
    kv_b = tiny_cache(cfg, layer_range=(split, 4))
    hidden = first.run_layers(first.embed(ids), b, kv_a)
    out = second.logits(second.run_layers(hidden, b, kv_b), b)
    assert torch.allclose(ref, out, atol=1e-5)
    with pytest.raises(RuntimeError, match="not the last stage"):
        first.logits(hidden, b)
    with pytest.raises(IndexError):
        kv_a.layer(split)


def test_batched_decode_equals_per_request():
    cfg = tiny_config()
    model = tiny_model(cfg)
    prompts = [[5, 6, 7], list(range(10, 31)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16]]
    solo_kv, batch_kv = tiny_cache(cfg), tiny_cache(cfg)
    solo_last = [_prefill(model, solo_kv, p, t)[0] for p, t in zip(prompts, tables)]
    # the batched cache gets the same prompts in one mixed step (several prefill sequences at once)
    slices, ids, start = [], [], 0
    for p, t in zip(prompts, tables):
        slices.append(SeqSlice(start, len(p), len(p), tuple(t)))
        ids += p
        start += len(p)
    logits = model.forward(torch.tensor(ids), ForwardBatch.build(slices, 4), batch_kv)
    for i in range(4):
        assert torch.allclose(logits[i], solo_last[i], atol=1e-5)
    lens = [len(p) for p in prompts]
    for step in range(4):
        nxt = [int(l.argmax()) for l in logits]
        slices = [SeqSlice(i, 1, lens[i] + 1, tuple(tables[i])) for i in range(4)]
        logits = model.forward(torch.tensor(nxt), ForwardBatch.build(slices, 4), batch_kv)
        for i in range(4):
            solo = _prefill(model, solo_kv, [nxt[i]], tables[i], past=lens[i])[0]
            assert torch.allclose(logits[i], solo, atol=1e-5), f"step {step} seq {i}"
        lens = [n + 1 for n in lens]


def test_layer_hook_sees_each_layer_after_its_kv_is_written(cfg):
    model = tiny_model(cfg)
    kv = tiny_cache(cfg)
    seen = []

    def hook(layer, batch):
        k, _ = kv.read(layer, [0, 1], 6)
        seen.append((layer, bool(k.abs().sum() > 0), batch.num_tokens))

    _prefill(model, kv, [1, 2, 3, 4, 5, 6], [0, 1], hook=hook)
    assert seen == [(0, True, 6), (1, True, 6)]


def test_bad_inputs_rejected(cfg):
    model = tiny_model(cfg)
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([SeqSlice(0, 9, 9, (0, 1))], 4)
    with pytest.raises(ValueError, match="tile"):
        ForwardBatch.build([SeqSlice(1, 2, 2, (0,))], 4)
    with pytest.raises(ValueError, match="bad sequence slice"):
        SeqSlice(0, 3, 2, (0,))
    b = ForwardBatch.build([SeqSlice(0, 2, 2, (0,))], 4)
    with pytest.raises(ValueError, match="do not match"):
        model.run_layers(torch.zeros(3, cfg.hidden_size), b, tiny_cache(cfg))
    with pytest.raises(ValueError, match="multiple"):
        tiny_config(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="layer range"):
        tiny_model(cfg, layer_range=(1, 5))


def _paged_setup(heads: tuple[int, int], dtype: torch.dtype, blocks: int, seed: int, head_dim: int = 16):
    """A tiny model with the paged attention kernels on, its cache of `blocks` 4-token blocks filled with
    random K/V, and the block ids shuffled (non-contiguous tables) -> (cfg, model, kv, block ids, generator).
    Skips where the kernels cannot be built."""
    from kvflow.model import cpu_kernels

    if not cpu_kernels.available("cpu"):
        pytest.skip("no C++ compiler for the CPU kernels on this machine")
    cfg = tiny_config(num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
    model = tiny_model(cfg)
    assert model.paged_kernel
    kv = KVCache(KVLayout.for_model(cfg, blocks, 4, dtype=dtype))
    kv.data.normal_(generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(seed)
    return cfg, model, kv, torch.randperm(blocks, generator=g).tolist(), g


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((4, 4), 16), ((6, 2), 16), ((9, 3), 64), ((2, 2), 32), ((4, 1), 128)],
                         ids=["gqa2", "mha", "gqa3", "smollm-64", "mha-32", "mqa-128"])
def test_paged_decode_kernel_equals_gather_path(dtype, tol, heads, head_dim):
    """(head dims that are multiples of 32 take the bf16 dot-product path in bf16 on AVX512-BF16 CPUs)"""
    cfg, model, kv, perm, g = _paged_setup(heads, dtype, 64, 4, head_dim)
    lens = [1, 4, 5, 17, 30, 61]  # ragged: a single token, exactly one block, block + 1, long, odd over 16-key groups
    tables, at = [], 0
    for n in lens:
        tables.append(tuple(perm[at : at + -(-n // 4)]))
        at += -(-n // 4)
    batch = ForwardBatch.build([SeqSlice(i, 1, n, t) for i, (n, t) in enumerate(zip(lens, tables))], 4)
    q = torch.randn(len(lens), cfg.num_heads, cfg.head_dim, generator=g).to(dtype)
    fast = model._decode_attention(0, q, batch, kv)
    threads = torch.get_num_threads()
    torch.set_num_threads(len(lens) + 1)  # fewer sequences than threads: one KV head per work item
    try:
        split = model._decode_attention(0, q, batch, kv)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, fast)
    model.paged_kernel = False
    slow = model._decode_attention(0, q, batch, kv)
    # and a plain per-sequence softmax(q k^T) v on the gathered K/V as the definition
    for i, (n, t) in enumerate(zip(lens, tables)):
        k, v = (x.float().repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1) for x in kv.read(0, list(t), n))
        p = torch.softmax(torch.einsum("hd,shd->hs", q[i].float(), k) * model.scale, dim=-1)
        ref = torch.einsum("hs,shd->hd", p, v)
        assert (fast[i].float() - ref).abs().max().item() < tol, f"sequence {i}"
    assert fast.dtype == dtype and (fast.float() - slow.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2), (8, 1)], ids=["gqa2", "mha", "gqa3", "mqa"])
def test_paged_prefill_kernel_equals_sdpa_path(dtype, tol, heads):
    # prompt chunks attended by the C++ kernel over the paged cache against the per-sequence SDPA path
    # and against the definition, in a step that also has decode rows: whole prompts, a chunk after
    # cached context, chunks longer than a query tile (the kernel's tile is 64 rows / G tokens)
    cfg, model, kv, perm, g = _paged_setup(heads, dtype, 160, 5)
    shapes = [(2, 2), (1, 9), (70, 70), (5, 33), (1, 4), (130, 200), (3, 3)]  # (query_len, context_len)
    seqs, start, at = [], 0, 0
    for ql, n in shapes:
        blocks = tuple(perm[at : at + -(-n // 4)])
        at += len(blocks)
        seqs.append(SeqSlice(start, ql, n, blocks))
        start += ql
    batch = ForwardBatch.build(seqs, 4)
    T = batch.num_tokens
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)  # strided rows, as the model passes them
    flat = kv.layer_kv(0).view(2, -1, KVH, D)  # the step's own K/V, as rope_write left them in the cache
    k, v = flat[0, batch.slot_mapping], flat[1, batch.slot_mapping]
    fast = model._attention(0, q, k, v, batch, kv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = model._attention(0, q, k, v, batch, kv)
        torch.set_num_threads(5)
        five = model._attention(0, q, k, v, batch, kv)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, fast) and torch.equal(five, fast)  # each tile is computed whole by one thread
    model.paged_kernel = False
    slow = model._attention(0, q, k, v, batch, kv)
    assert fast.dtype == dtype and (fast.float() - slow.float()).abs().max().item() < tol
    for s in seqs:  # the definition: softmax over keys up to the query's position
        keys, vals = (x.float().repeat_interleave(H // KVH, dim=1) for x in kv.read(0, list(s.block_ids), s.context_len))
        rows = slice(s.query_start, s.query_start + s.query_len)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * model.scale
        pos = torch.arange(s.query_len)[:, None] + s.context_len - s.query_len
        scores = scores.masked_fill(torch.arange(s.context_len)[None, :] > pos, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vals)
        assert (fast[rows].float() - ref).abs().max().item() < tol, s


def test_paged_prefill_kernel_rejects_bad_tables():
    from kvflow.model import cpu_kernels

    if not cpu_kernels.available("cpu"):
        pytest.skip("no C++ compiler for the CPU kernels on this machine")
    cfg = tiny_config()
    kv = KVCache(KVLayout.for_model(cfg, 8, 4))
    q = torch.randn(6, cfg.num_heads, cfg.head_dim)
    one = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    run = lambda table, start, qlen, ctx: cpu_kernels.paged_prefill_attention(  # noqa: E731
        q, kv.layer_kv(0), torch.tensor([table], dtype=torch.long), one(start), one(qlen), one(ctx), 0.1)
    assert run([0, 1], 0, 6, 6).shape == q.shape
    with pytest.raises(RuntimeError, match="block id"):
        run([0, 8], 0, 6, 6)
    with pytest.raises(RuntimeError, match="too few blocks"):
        run([0], 0, 6, 6)
    with pytest.raises(RuntimeError, match="rows"):
        run([0, 1], 2, 6, 6)
    with pytest.raises(RuntimeError, match="rows"):
        run([0, 1], 0, 6, 5)
    g = cpu_kernels._op.prefill_max_group() + 1  # a query tile holds at least one token's heads
    assert not cpu_kernels.paged_attention_supported(cfg.head_dim, g, 1)
    assert cpu_kernels.paged_attention_supported(cfg.head_dim, g - 1, 1)
    with pytest.raises(RuntimeError, match="query heads per KV head"):
        cpu_kernels.paged_prefill_attention(torch.randn(6, g, cfg.head_dim), torch.zeros(2, 2, 4, 1, cfg.head_dim),
                                            torch.tensor([[0, 1]]), one(0), one(6), one(6), 0.1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_prepared_linear_equals_f_linear_on_every_row_count(dtype, tol):
    from kvflow.model import linear
    from kvflow.model.linear import Linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    lin = Linear(w)
    for path in linear.small_paths(dtype):  # whichever path the load-time measurement picks
        lin.small = dict.fromkeys(range(1, 17), path)
        for rows in (1, 2, 3, 4, 16, 100):
            x = torch.randn(rows, 32, generator=g).to(dtype)
            ref = x.float() @ w.float().t()
            assert (lin(x).float() - ref).abs().max().item() < tol * ref.abs().max().item(), (path, rows)


def test_small_row_paths_are_measured_or_overridden(monkeypatch):
    from kvflow.model import linear

    lins = [linear.Linear(torch.randn(64, 48)) for _ in range(4)]
    if lins[0].packed is None:
        pytest.skip("no oneDNN prepacked linear in this torch build")
    monkeypatch.setattr(linear, "_SMALL", {})
    monkeypatch.delenv("KVFLOW_LINEAR_SMALL_ROWS", raising=False)
    chosen = linear.choose_small_paths(lins)
    assert set(chosen) == set(range(1, linear.SMALL_ROWS[-1] + 1)) and set(chosen.values()) <= set(linear.small_paths(torch.float32))
    assert chosen[5] == chosen[4] and chosen[15] == chosen[12]  # between measured counts: the lower one's
    assert len(linear._SMALL) == 1 and list(linear._SMALL)[0][:2] == (torch.float32, torch.get_num_threads())
    assert linear.choose_small_paths(lins) is chosen  # measured once, then cached
    monkeypatch.setenv("KVFLOW_LINEAR_SMALL_ROWS", "padded")
    assert linear.choose_small_paths(lins) == dict.fromkeys(range(1, linear.SMALL_ROWS[-1] + 1), "padded")
    monkeypatch.setenv("KVFLOW_LINEAR_SMALL_ROWS", "fast")
    with pytest.raises(ValueError):
        linear.choose_small_paths(lins)
    monkeypatch.setenv("KVFLOW_LINEAR_PATHS", "plain,prepacked")  # the candidates, restricted for comparisons
    assert linear.small_paths(torch.bfloat16) == ("plain", "prepacked")
    monkeypatch.setenv("KVFLOW_LINEAR_PATHS", "kernel")
    with pytest.raises(ValueError, match="plain or prepacked"):
        linear.small_paths(torch.float32)


def test_a_replacement_adopts_the_small_row_paths_its_predecessor_chose(monkeypatch):
    """`adopt_small_paths` (a replacement stage, `WorkerSpec.small_paths`): the choice is taken as it is,
    nothing measured, and reported back by `chosen_small_paths` as it came; a choice naming a path
    this machine lacks, or padded/kernel beyond FEW_ROWS, or of the wrong length, is not adopted."""
    from kvflow.model import linear

    lins = [linear.Linear(torch.randn(64, 48)) for _ in range(4)]
    if lins[0].packed is None:
        pytest.skip("no oneDNN prepacked linear in this torch build")
    monkeypatch.setattr(linear, "_SMALL", {})
    monkeypatch.delenv("KVFLOW_LINEAR_SMALL_ROWS", raising=False)
    n, paths = linear.SMALL_ROWS[-1], linear.small_paths(torch.float32)
    assert linear.chosen_small_paths(torch.float32) == []  # (nothing chosen yet)
    # a choice no measurement would make here (alternating, row by row): taken as given
    choice = ["plain" if r % 2 else "prepacked" for r in range(1, n + 1)]
    assert linear.adopt_small_paths(torch.float32, choice)
    for path in paths:  # (a measurement would run every path over the linears)
        for lin in lins:
            monkeypatch.setattr(lin, path, lambda x, path=path: pytest.fail(f"measured {path} instead of adopting"))
    assert linear.choose_small_paths(lins) == dict(enumerate(choice, 1))
    assert linear.chosen_small_paths(torch.float32) == choice
    # a choice this machine cannot run (another node's paths, a wrong length) is not adopted: measured instead
    monkeypatch.setattr(linear, "_SMALL", {})
    for bad in (choice[:-1], ["fast"] * n, ["padded"] * n if "padded" in paths else ["fast"]):
        assert not linear.adopt_small_paths(torch.float32, bad) and linear.chosen_small_paths(torch.float32) == []


def test_kernel_build_is_shared_by_checkouts_and_survives_a_killed_builder(tmp_path):
    # the build is keyed by content (sources, compiler, torch, CPU), not by the checkout: a second
    # checkout (a copy of the package on another path) loads the same build without compiling; what a
    # builder killed mid-way leaves behind (its own directory, torch's lock file in it) blocks no one
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from kvflow.model import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels cannot be built here (no compiler)")
    final = cpu_kernels.build_directory()
    sources = cpu_kernels._read_sources()
    assert cpu_kernels.build_directory(dict(sources)) == final
    assert cpu_kernels.build_directory({**sources, "ops.h": sources["ops.h"] + b"\n"}) != final
    built = final / f"{final.name}.so"
    mtime = built.stat().st_mtime_ns
    stale = final.with_name(final.name + ".tmp-4194305")
    stale.mkdir()
    (stale / "lock").touch()
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(cpu_kernels.__file__).parents[1], checkout / "kvflow",
                    ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import sys\nfrom kvflow.model import cpu_kernels as p\n"
             f"assert p.__file__.startswith({str(checkout)!r}), p.__file__\n"
             f"assert str(p.build_directory()) == {str(final)!r}\n"
             "sys.exit(0 if p.available() else 3)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "compiling" not in r.stderr and built.stat().st_mtime_ns == mtime  # loaded, not rebuilt
    assert not stale.exists()

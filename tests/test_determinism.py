"""Batch invariance: a token's logits, K/V and greedy continuation do not depend on what else shares its
steps, where it sits, how its prompt is chunked or whether it was decoded or prefilled — bitwise, in
bf16 (the default dtype where the CPU has native bf16; on CPUs without it the same kernels run their
float32-FMA path) and in float32."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import cpu_kernels
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.linear import Linear
from kvflow.model.llama import LlamaModel
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import SchedulerConfig

from conftest import TINY_VOCAB, run_to_completion, tiny_config, tiny_state_dict

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="batch invariance needs the CPU kernels (a C++ compiler)")

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


# ----------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("out,width", [(48, 64), (33, 37), (200, 576)], ids=["64", "odd", "576"])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype, out, width):
    g = torch.Generator().manual_seed(out + width)
    w = torch.randn(out, width, generator=g).to(dtype)
    lin = Linear(w, deterministic=True)
    assert lin.invariant is not None and lin.packed is None
    x = torch.randn(300, width, generator=g).to(dtype)
    full = lin(x)
    ref = x.double() @ w.double().t()
    # float32 accumulation over up to 576 products, then one rounding to the dtype
    tol = {torch.float32: 1e-4, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    assert ((full.double() - ref).abs() / (1 + ref.abs())).max().item() <= tol
    for rows in (1, 2, 3, 5, 6, 7, 15, 16, 17, 31, 32, 33, 64, 100, 193, 299):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows
        assert torch.equal(lin(x[300 - rows:]), full[300 - rows:]), rows  # the same rows at other positions
    perm = torch.randperm(300, generator=g)
    assert torch.equal(lin(x[perm]), full[perm])
    for i in (0, 1, 150, 299):
        assert torch.equal(lin(x[i:i + 1]), full[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 16), ((9, 3), 64), ((4, 4), 32), ((8, 1), 128)],
                         ids=["tiny", "smollm", "mha-32", "mqa-128"])
def test_decoded_token_attends_as_in_any_prompt_chunk(dtype, heads, head_dim):
    # the invariant decode attention of a token == its row in a prompt chunk of any length, bitwise
    H, KVH = heads
    D, bs, n = head_dim, 4, 150  # 150 keys: more than two of the prefill kernel's 64-key tiles
    g = torch.Generator().manual_seed(H * D)
    kv = torch.randn(2, 64, bs, KVH, D, generator=g).to(dtype)
    table = torch.randperm(64, generator=g)[: -(-n // bs)].view(1, -1)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    one = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    whole = cpu_kernels.paged_prefill_attention(q, kv, table, one(0), one(n), one(n), 0.125)
    for qlen in (1, 2, 7, 63, 64, 65):  # the last qlen tokens as one chunk after the rest
        chunk = cpu_kernels.paged_prefill_attention(q[n - qlen:], kv, table, one(0), one(qlen), one(n), 0.125)
        assert torch.equal(chunk, whole[n - qlen:]), qlen
    ctx = torch.tensor([1, 2, 17, 64, 65, 128, 150])
    rows = cpu_kernels.paged_decode_attention(q[ctx - 1], kv, table.expand(len(ctx), -1).contiguous(), ctx, 0.125,
                                              invariant=True)
    assert torch.equal(rows, whole[ctx - 1])


_OTHER_CPU = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import tiny_config, tiny_state_dict
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import cpu_kernels
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.linear import Linear
from kvflow.model.llama import LlamaModel
assert cpu_kernels.available()
print(cpu_kernels.invariant_linear_isa(torch.bfloat16))
g = torch.Generator().manual_seed(0)
for out, width in ((48, 64), (33, 37), (200, 576)):
    w = torch.randn(out, width, generator=g).bfloat16()
    lin = Linear(w, deterministic=True)
    x = torch.randn(300, width, generator=g).bfloat16()
    full = lin(x)
    ref = x.double() @ w.double().t()
    assert ((full.double() - ref).abs() / (1 + ref.abs())).max().item() <= 2**-8
    for rows in (1, 2, 3, 5, 6, 7, 16, 17, 33, 100, 299):
        assert torch.equal(lin(x[:rows]), full[:rows]) and torch.equal(lin(x[300 - rows:]), full[300 - rows:]), rows
cfg = tiny_config()
model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg, 3), dtype=torch.bfloat16)
seqs = [[5, 9, 30, 2, 7, 8, 11], [40, 41], [3] * 13]
alone = []
for s in seqs:
    kv = KVCache(KVLayout.for_model(cfg, 16, 4, dtype=torch.bfloat16))
    alone.append(model.forward(torch.tensor(s), ForwardBatch.build([SeqSlice(0, len(s), len(s), (0, 1, 2, 3))], 4), kv)[0])
kv = KVCache(KVLayout.for_model(cfg, 16, 4, dtype=torch.bfloat16))
starts = [sum(map(len, seqs[:i])) for i in range(len(seqs))]
slices = [SeqSlice(q0, len(s), len(s), tuple(range(4 * i, 4 * i + 4))) for i, (q0, s) in enumerate(zip(starts, seqs))]
both = model.forward(torch.tensor(sum(seqs, [])), ForwardBatch.build(slices, 4), kv)
assert all(torch.equal(a, b) for a, b in zip(alone, both))
"""


@pytest.mark.parametrize("isa", ["avx512-bf16", "fma"])
def test_other_cpus_projection_paths_are_batch_invariant(isa):
    """The bf16 projection paths of other CPUs, forced on this one (KVFLOW_INVARIANT_ISA, in a fresh
    process: the choice is made once): AVX512-BF16 dot products (a CPU without AMX) and float32
    FMAs on widened bf16 (a CPU without native bf16) — rows against any batch, and a tiny model's
    logits alone against batched."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = _OTHER_CPU.format(tests=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KVFLOW_INVARIANT_ISA=isa),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.split()[0] != isa:
        pytest.skip(f"{isa} is not built on this CPU (it runs {r.stdout.split()[0]})")


# ----------------------------------------------------------------------------- the model, step by step
def _model(dtype: torch.dtype, layers: int = 2, head_dim: int = 16) -> LlamaModel:
    # head_dim 32: 2 query heads on 1 KV head (the attention kernel's AMX and paired-V paths need 32s)
    heads = dict(num_heads=2, num_kv_heads=1, head_dim=32) if head_dim == 32 else {}
    cfg = tiny_config(num_layers=layers, **heads)
    model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg, 11), dtype=dtype)
    assert model.batch_invariant
    return model


def _kv_of(kv: KVCache, model: LlamaModel, blocks, n: int) -> torch.Tensor:
    return torch.stack([torch.stack(kv.read(layer, list(blocks), n)) for layer in range(model.cfg.num_layers)])


@DTYPES
@pytest.mark.parametrize("head_dim", [16, 32])
def test_logits_and_kv_do_not_depend_on_batch_chunking_or_decode(dtype, head_dim):
    """Twelve sequences: each alone (whole prompt in one chunk, then decode steps) against all of them
    in random mixed steps — prompt chunks of random lengths (1-token chunks are decode rows), decode
    rows, shuffled order, other blocks, a different thread count — same logits and K/V, bitwise."""
    model = _model(dtype, head_dim=head_dim)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 45))] for _ in range(12)]
    decodes = 3
    follow = [[(7 * i + j) % TINY_VOCAB for j in range(decodes)] for i in range(len(seqs))]
    bs = 4
    need = [-(-(len(s) + decodes) // bs) for s in seqs]

    def layout():
        return KVLayout.for_model(model.cfg, sum(need) + 8, bs, dtype=dtype)

    # alone
    ref_logits, ref_kv = [], []
    for i, s in enumerate(seqs):
        kv = KVCache(layout())
        blocks = tuple(range(need[i]))
        out = [model.forward(torch.tensor(s), ForwardBatch.build([SeqSlice(0, len(s), len(s), blocks)], bs), kv)[0]]
        for j, t in enumerate(follow[i]):
            n = len(s) + j + 1
            out.append(model.forward(torch.tensor([t]), ForwardBatch.build([SeqSlice(0, 1, n, blocks)], bs), kv)[0])
        ref_logits.append(torch.stack(out))
        ref_kv.append(_kv_of(kv, model, blocks, len(s) + decodes))

    # together, in random steps
    kv = KVCache(layout())
    ids = list(range(kv.layout.num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(tuple(ids[at:at + k]))
        at += k
    tokens = [s + f for s, f in zip(seqs, follow)]
    done = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        while any(d < len(t) for d, t in zip(done, tokens)):
            live = [i for i, t in enumerate(tokens) if done[i] < len(t)]
            step = rng.sample(live, rng.randint(1, len(live)))
            slices, ids_, start, takes = [], [], 0, []
            for i in step:
                if done[i] < len(seqs[i]):  # prompt: a chunk of 1 .. the rest
                    take = rng.randint(1, len(seqs[i]) - done[i])
                else:
                    take = 1
                slices.append(SeqSlice(start, take, done[i] + take, tables[i]))
                ids_ += tokens[i][done[i]:done[i] + take]
                start += take
                takes.append(take)
            logits = model.forward(torch.tensor(ids_), ForwardBatch.build(slices, bs), kv)
            for row, (i, take) in enumerate(zip(step, takes)):
                done[i] += take
                if done[i] >= len(seqs[i]):  # the prompt is in: this row's logits are a sampled position
                    got[i].append(logits[row])
    finally:
        torch.set_num_threads(threads)
    for i in range(len(seqs)):
        assert torch.equal(torch.stack(got[i]), ref_logits[i]), f"sequence {i} (prompt of {len(seqs[i])})"
        assert torch.equal(_kv_of(kv, model, tables[i], len(tokens[i])), ref_kv[i]), f"K/V of sequence {i}"


@DTYPES
def test_native_decode_step_equals_per_op_step_and_prefill(dtype):
    # decode_layers (a decode-only step in one native call) is the same arithmetic as the per-op path
    model = _model(dtype)
    bs, s = 4, [5, 9, 3, 17, 2, 30, 8]
    kv = KVCache(KVLayout.for_model(model.cfg, 64, bs, dtype=dtype))
    model.forward(torch.tensor(s), ForwardBatch.build([SeqSlice(0, len(s), len(s), tuple(range(3)))], bs), kv)
    b = ForwardBatch.build([SeqSlice(0, 1, len(s) + 1, tuple(range(3)))], bs)
    native = model.forward(torch.tensor([4]), b, kv)
    model.native_decode = False
    per_op = model.forward(torch.tensor([4]), b, kv)
    assert torch.equal(native, per_op)
    kv2 = KVCache(kv.layout)  # the same token prefilled with its prompt
    whole = model.forward(torch.tensor(s + [4]), ForwardBatch.build([SeqSlice(0, len(s) + 1, len(s) + 1, tuple(range(3)))], bs), kv2)
    assert torch.equal(whole, native)


# ----------------------------------------------------------------------------- the engine
def _engine(model: LlamaModel, dtype: torch.dtype, budget: int, chunk: int, prefix: bool = True) -> LLMEngine:
    config = EngineConfig(dtype=str(dtype).removeprefix("torch."), block_size=4, num_kv_blocks=2048,
                          enable_prefix_caching=prefix,
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, prefill_chunk_size=chunk, max_num_seqs=64))
    return LLMEngine(model, None, config)


def _generate(engine: LLMEngine, prompts, params) -> list[list[int]]:
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = run_to_completion(engine)
    return [list(final[r.request_id].token_ids) for r in reqs]


@DTYPES
@pytest.mark.parametrize("head_dim", [16, 32])
def test_greedy_tokens_alone_equal_tokens_in_any_batch(dtype, head_dim):
    """64 prompts of 1-60 tokens (a few sharing prefixes: prefix-cache hits in the batched runs), each
    generated alone with its whole prompt in one step, then in batches of 1 to 64 with small token
    budgets (chunked prompts beside other requests' decodes, prompts split at other places, requests
    joining and leaving): the same greedy tokens, bitwise."""
    model = _model(dtype, head_dim=head_dim)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(56)]
    prompts += [prompts[i][: max(1, len(prompts[i]) - 3)] + [5, 6] for i in range(8)]  # shared prefixes
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=0, ignore_eos=True) for _ in prompts]
    alone = []
    for p, sp in zip(prompts, params):
        alone.append(_generate(_engine(model, dtype, 512, 512, prefix=False), [p], [sp])[0])
    assert len({tuple(t) for t in alone}) > 48  # the model does not collapse to a few continuations

    order = list(range(len(prompts)))
    rng.shuffle(order)
    runs = [(64, 16, 8), (32, 24, 5), (16, 40, 17), (8, 300, 256), (5, 9, 3), (3, 64, 64), (2, 12, 12), (1, 20, 7)]
    checked = 0
    for size, budget, chunk in runs:
        engine = _engine(model, dtype, budget, chunk)
        for at in range(0, len(order), size) if size >= 8 else [0]:  # every prompt in the big batches, a few in the small
            group = order[at:at + size]
            rng.shuffle(group)
            got = _generate(engine, [prompts[i] for i in group], [params[i] for i in group])
            for i, tokens in zip(group, got):
                assert tokens == alone[i], f"prompt {i} ({len(prompts[i])} tokens) in a batch of {len(group)}"
                checked += 1
    assert checked == 4 * 64 + 5 + 3 + 2 + 1


# ----------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_real_model_greedy_alone_equals_batched_in_bf16():
    from kvflow import LLM

    llm = LLM(dtype="bfloat16", deterministic=True, kv_cache_memory_gb=0.25)  # 88 blocks of 128 tokens; 8 used
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three uses of a paperclip.",
               "Once upon a time", "def fibonacci(n):", "The quick brown fox", "In 1969, astronauts", "Water boils at"]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, sp)]
    for i in (0, 3, 6):
        assert llm.generate([prompts[i]], sp)[0].token_ids == batched[i], prompts[i]


def test_deterministic_switch_reaches_the_model(tiny_ckpt_dir):
    for on in (True, False):
        eng = LLMEngine.from_config(EngineConfig(model=str(tiny_ckpt_dir), dtype="bfloat16", num_kv_blocks=64,
                                                 block_size=4, deterministic=on))
        assert eng.model.batch_invariant == on
        assert eng.model.layers[0].qkv.batch_invariant == on
    assert EngineConfig().deterministic is False  # off by default: what it costs is in docs/results.md
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic="yes")


# ----------------------------------------------------------------------------- layouts and failures, bf16
# The same requests through the engine and through every pipeline layout (worker processes), in bf16
# with deterministic=True: the same tokens, greedy and seeded, whatever the batching, chunking,
# preemption, prefix hits, host-tier round trips, swapping or a SIGKILLed worker did to the steps.
def _bf16_engine_config(ckpt, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="bfloat16", deterministic=True, block_size=4, **kw)


_ENGINE_TOKENS: dict[str, tuple[str, list[list[int]]]] = {}


def _engine_tokens(ckpt, prompts, params) -> tuple[str, list[list[int]]]:
    """(the bf16 engine's kernel variant, each request's tokens from it: whole prompts in one step, room
    for every request); computed once per checkpoint and request set (the layouts share them)."""
    key = repr((str(ckpt), prompts, params))
    if key not in _ENGINE_TOKENS:
        engine = LLMEngine.from_config(_bf16_engine_config(ckpt, num_kv_blocks=512))
        assert engine.model.kernel_variant.startswith("batch-invariant bfloat16")
        _ENGINE_TOKENS[key] = engine.model.kernel_variant, _generate(engine, prompts, params)
    return _ENGINE_TOKENS[key]


def _cluster(ckpt, kw: dict):
    from kvflow.config import ClusterConfig

    kw = dict(kw)
    engine = _bf16_engine_config(ckpt, num_kv_blocks=kw.pop("num_kv_blocks", 128), host_kv_bytes=kw.pop("host_kv_bytes", 0),
                                 scheduler=kw.pop("scheduler", SchedulerConfig()))
    return ClusterConfig(engine=engine, microbatch_size=4, prompt_microbatch_size=2, heartbeat_timeout_s=30.0, **kw)


def _serve(cfg, prompts, params, waves):
    """The requests streamed through a controller, each wave's (lists of request indices) at once, one
    wave after the other -> (tokens per request, each stage's kernel variant, the controller's stats,
    its preemptions)."""
    import asyncio

    from kvflow.controller.controller import Controller

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()

        async def one(i):
            toks = []
            async for out in ctrl.generate(prompts[i], params[i], f"r{i}"):
                toks += out.new_token_ids
            return toks

        try:
            got = {}
            for wave in waves:
                got.update(zip(wave, await asyncio.gather(*map(one, wave))))
            return [got[i] for i in range(len(prompts))], dict(ctrl.workers.kernel_variants), ctrl.stats(), ctrl.preemptions
        finally:
            await ctrl.shutdown()

    return asyncio.run(main())


def _layout_requests():
    """Prompts of 2-40 tokens, five of them sharing a 20-token prefix (prefix hits); every third
    request samples at temperature 0.8 with its own seed. In three waves: two of the shared-prefix
    requests, the nine others (their blocks push the prefix out of a small KV pool), the other three
    shared-prefix requests (the prefix comes back from a host tier, or is recomputed)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(9)]
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(20)]
    prompts += [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    params = [SamplingParams(max_tokens=rng.randint(8, 30), ignore_eos=True,
                             **(dict(temperature=0.8, seed=100 + i) if i % 3 == 1 else dict(temperature=0)))
              for i in range(len(prompts))]
    return prompts, params, [[9, 10], list(range(9)), [11, 12, 13]]


TIGHT = dict(num_kv_blocks=24, scheduler=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8, reserve_kv=False))


@pytest.mark.parametrize("kw", [
    dict(mode="colocated", depth=1, **TIGHT),
    dict(mode="colocated", depth=2, **TIGHT),
    dict(mode="colocated", depth=3, **TIGHT),
    dict(mode="disaggregated", prompt_depth=1, token_depth=1, **TIGHT),
    dict(mode="disaggregated", prompt_depth=1, token_depth=2, **TIGHT),
    dict(mode="disaggregated", prompt_depth=2, token_depth=1, **TIGHT),
    dict(mode="disaggregated", prompt_depth=2, token_depth=2, **TIGHT),
    dict(mode="colocated", depth=2, swapping=True),
    dict(mode="colocated", depth=2, num_kv_blocks=24, host_kv_bytes=128),  # blocks, turned into bytes below
], ids=["colocated-1", "colocated-2", "colocated-3", "disagg-1-1", "disagg-1-2", "disagg-2-1", "disagg-2-2",
        "colocated-2:swapping", "colocated-2:host-tier"])
def test_bf16_every_layout_gives_the_engine_tokens(tiny_ckpt_dir, tiny4_ckpt_dir, kw):
    """TIGHT: prompts chunked 8 tokens at a time beside other requests' decodes, and a KV pool too small
    for all of them (preempted requests are recomputed), none of which the engine's run has."""
    ckpt = tiny4_ckpt_dir if kw.get("depth", 0) > 2 else tiny_ckpt_dir
    prompts, params, waves = _layout_requests()
    engine_variant, expected = _engine_tokens(ckpt, prompts, params)
    if "host_kv_bytes" in kw:
        kw = dict(kw, host_kv_bytes=kw["host_kv_bytes"] * KVLayout.for_model(tiny_config(), 1, 4, dtype=torch.bfloat16).bytes_per_block)
    cfg = _cluster(ckpt, kw)
    got, variants, stats, preemptions = _serve(cfg, prompts, params, waves)
    assert got == expected
    if "scheduler" in kw:
        assert preemptions > 0, "the small KV pool was meant to force preemption"
    if "host_kv_bytes" in kw:
        assert stats.prefix_cache[(cfg.pipelines()[0].name, "host")].hits > 0, "prefix blocks were meant to come back from host"
    assert set(variants.values()) == {engine_variant}, variants


@pytest.mark.parametrize("kw, victim", [
    (dict(mode="colocated", depth=2, replication="none"), "colocated-1"),
    (dict(mode="colocated", depth=3), "colocated-1"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=2), "prompt-0"),
    (dict(mode="disaggregated", prompt_depth=2, token_depth=2), None),
    (dict(mode="colocated", depth=2, swapping=True), "colocated-1"),
], ids=["colocated-2:recompute", "colocated-3:replica", "disagg-1-1:token", "disagg-1-2:prompt", "disagg-2-2:random",
        "colocated-2:swapping"])
def test_bf16_a_killed_worker_changes_no_token(tiny_ckpt_dir, tiny4_ckpt_dir, kw, victim):
    """tests/test_recovery.py's requests and failures (SIGKILL after 20 tokens, of a named or a random
    worker; resumed from a replica, or recomputed) in bf16: every stream is the bf16 engine's."""
    from test_recovery import PROMPTS, params, run_with_failure

    ckpt = tiny4_ckpt_dir if kw.get("depth", 0) > 2 else tiny_ckpt_dir
    _, expected = _engine_tokens(ckpt, PROMPTS, [params(i) for i in range(len(PROMPTS))])
    replicated = kw.get("replication") != "none" and kw["mode"] == "colocated"
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(_cluster(ckpt, kw), victim, "kill", 20, replicated)
    assert failures == 1 and recoveries == 1 and healthy
    assert streamed == expected and [f.token_ids for f in finals] == expected


def test_stages_computing_with_different_kernels_fail_the_start(tiny_ckpt_dir, monkeypatch):
    """A token worker started with the CPU kernels off (as on a host without a compiler) is not
    batch-invariant while the prompt worker is: a request's prompt pass and decode steps would be
    computed differently, so the controller refuses to start, naming both."""
    import asyncio

    from kvflow.controller.controller import Controller
    from kvflow.controller.launcher import SubprocessLauncher

    class TokenWorkerWithoutKernels(SubprocessLauncher):
        def start(self, name, controller_addr, host, secret):
            with monkeypatch.context() as env:  # a worker gets the environment of the moment it starts
                if name == "token-0":
                    env.setenv("KVFLOW_CPU_KERNELS", "0")
                return super().start(name, controller_addr, host, secret)

    cfg = _cluster(tiny_ckpt_dir, dict(mode="disaggregated", prompt_depth=1, token_depth=1))
    ctrl = Controller(cfg, launcher=TokenWorkerWithoutKernels())
    try:
        with pytest.raises(RuntimeError, match=r"computes with kernels '(per-shape|batch-invariant) bfloat16.*' but "
                                               r"(prompt|token)-0 with .*would change its tokens") as err:
            asyncio.run(ctrl.start())
    finally:
        asyncio.run(ctrl.shutdown())  # its sockets: a ZeroMQ context collected with sockets open blocks the exit
    assert "'per-shape bfloat16'" in str(err.value) and "'batch-invariant bfloat16" in str(err.value)

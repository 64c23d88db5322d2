"""kvflow on a CUDA device: the model against `transformers`, the engine eager and with CUDA graphs,
the same tokens as on the CPU. Every test here needs a GPU (`pytest -m cuda` on a GPU machine);
without one they skip, and their CPU halves (the Triton kernel interpreted, the graph buffers run
eagerly) are tested in tests/test_triton_attention.py and tests/test_cuda_graphs.py."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import tiny_config, tiny_state_dict

from kvflow.config import EngineConfig
from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.engine.engine import LLMEngine
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LlamaModel
from kvflow.sched.config import SchedulerConfig
from kvflow.sched.sampling import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 17, 3, 40] * 3, [8, 1, 2], list(range(10, 47))]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def engine(device: str, eager: bool = True, dtype: str = "float32", deterministic: bool = False,
           gpu_memory_utilization: float | None = None, **sched) -> LLMEngine:
    cfg = tiny_config()
    model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=getattr(torch, dtype), device=device,
                                       deterministic=deterministic)
    blocks = None if gpu_memory_utilization else 64
    return LLMEngine(model, None, EngineConfig(device=device, dtype=dtype, block_size=16, num_kv_blocks=blocks, enforce_eager=eager,
                                               deterministic=deterministic, gpu_memory_utilization=gpu_memory_utilization,
                                               scheduler=SchedulerConfig(**sched)))


def greedy(eng: LLMEngine, n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, params).request_id for p in PROMPTS]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[r] for r in ids]


def test_the_model_on_cuda_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = tiny_config()
    ref = LlamaForCausalLM(LlamaConfig(**cfg.to_hf())).eval()
    ref.load_state_dict(tiny_state_dict(cfg), strict=False)
    ref = ref.cuda()
    model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=torch.float32, device="cuda")
    assert model.triton_attention
    cache = KVCache(KVLayout.for_model(cfg, 16, 16), "cuda")
    p = PROMPTS[2]
    with torch.inference_mode():
        want = ref(torch.tensor([p], device="cuda")).logits[0, -1].float()
        got = model.forward(torch.tensor(p, device="cuda"), ForwardBatch.of([(len(p), len(p), [3, 9, 1])], 16, "cuda"), cache)
    assert (got[0] - want).abs().max().item() < 1e-4


def test_greedy_tokens_on_cuda_equal_the_cpus_in_float32():
    assert greedy(engine("cuda")) == greedy(engine("cpu"))


def test_cuda_graphs_give_the_eager_tokens():
    graphed = engine("cuda", eager=False)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.capture
    assert greedy(graphed) == greedy(engine("cuda"))


def test_decoding_ahead_on_captured_graphs_gives_the_serial_engines_tokens():
    """The engine launching each greedy decode step before reading the previous one's ids back (their
    argmax gathered inside the graph): requests of many lengths, stop ids met mid-flight, an abort
    while a step is on the device, a seeded sampled request and requests arriving while ahead give
    the serial engine's tokens, and every block comes back (the CPU half: tests/test_decode_ahead_engine.py)."""
    from test_decode_ahead_engine import drive, prompt, tokens

    def build(ahead: bool) -> LLMEngine:
        cfg = tiny_config()
        model = LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=torch.float32, device="cuda", deterministic=True)
        eng = LLMEngine(model, None, EngineConfig(device="cuda", block_size=16, num_kv_blocks=96, deterministic=True,
                                                  decode_ahead=ahead, scheduler=SchedulerConfig(max_num_seqs=16)))
        assert eng.runner.graphs is not None and eng.runner.graphs.capture and eng.decode_ahead == ahead
        return eng

    greedy = [SamplingParams(max_tokens=3 + (4 * i) % 17, temperature=0, ignore_eos=True) for i in range(12)]
    first = tokens(drive(build(False), {0: [(prompt(i), greedy[i], f"r{i}") for i in range(12)]}))
    for i in (2, 7):  # these two stop at an id they produce mid-way
        greedy[i] = SamplingParams(max_tokens=greedy[i].max_tokens, temperature=0, stop_token_ids=[first[f"r{i}"][2]])
    work = {0: [(prompt(i), greedy[i], f"r{i}") for i in range(10)],
            5: [(prompt(i), greedy[i], f"r{i}") for i in (10, 11)],
            9: [(prompt(12), SamplingParams(max_tokens=5, temperature=0.7, seed=3, ignore_eos=True), "s")]}
    aborts = {6: ["r4"]}
    serial, eng = drive(build(False), work, aborts), build(True)
    ahead = drive(eng, work, aborts)
    assert eng.runner.launches > 10
    got = {r: [t for new, _, _ in outs for t in new] for r, outs in ahead.items()}
    want = {r: [t for new, _, _ in outs for t in new] for r, outs in serial.items()}
    assert {r: t for r, t in got.items() if r != "r4"} == {r: t for r, t in want.items() if r != "r4"}
    assert got["r4"] == first["r4"][:len(got["r4"])] and not any(f for _, f, _ in ahead["r4"])
    assert [ahead[f"r{i}"][-1][2] for i in (2, 7)] == ["stop", "stop"]


def test_a_replayed_graph_gives_the_eager_logits():
    eng = engine("cuda")
    greedy(eng, 2)  # some KV in the cache
    graphs = DecodeGraphs(eng.model, eng.kv_cache, max_batch=8, max_model_len=128, buckets=(2, 8))
    contexts = [(20, [1, 2]), (7, [5])]
    got = graphs.run(contexts, tokens=[4, 9]).clone()
    want = eng.model.forward(torch.tensor([4, 9], device="cuda"), ForwardBatch.of([(1, c, b) for c, b in contexts], 16, "cuda"),
                             eng.kv_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_fused_decode_projections_are_measured_and_give_the_separate_kernels_tokens(monkeypatch):
    """A model not `deterministic` measures the fused decode projections against the separate kernels
    when it loads (`decode_fusion`: it must not fail on the device); forced on, its graphed float32
    steps give the tokens of the separate kernels (tests/test_triton_fused_linear.py compares the
    kernels and the logits on the device)."""
    from kvflow.model.decode_fusion import FUSED_ROWS

    choice = engine("cuda", dtype="bfloat16").model.fusion
    assert choice.why == "measured" and [m.rows for m in choice.measured] == list(FUSED_ROWS), choice
    tokens = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("KVFLOW_FUSED_PROJECTIONS", forced)
        eng = engine("cuda", eager=False)
        assert bool(eng.model.fusion.rows) == (forced == "1") and eng.runner.graphs is not None
        tokens[forced] = greedy(eng)
        assert eng.runner.graphs.replay_ms(3) > 0  # (what benchmarks/gpu.py reports)
    assert tokens["1"] == tokens["0"]


def test_the_kv_cache_takes_what_the_gpu_memory_leaves():
    """gpu_memory_utilization: the cache gets the fraction of the device's memory less what is in use
    and a step's measured peak (one GiB over what is held now, here), and serves the same tokens."""
    from kvflow.engine.memory import RESERVE_BYTES

    # A first engine loads what any engine in this process loads once and keeps (kernel modules, cuBLAS
    # workspaces): counted in the reading below, not in the budget it is compared with.
    want = greedy(engine("cuda"))
    gc.collect()
    torch.cuda.empty_cache()  # (as the engine's measurement does: memory this process cached but holds no tensor in is free)
    free, total = torch.cuda.mem_get_info()
    util = (total - free + (1 << 30)) / total
    eng = engine("cuda", gpu_memory_utilization=util)
    layout = eng.kv_cache.layout
    budget = layout.num_blocks * layout.bytes_per_block
    assert 0 < budget <= (1 << 30) - RESERVE_BYTES
    assert budget > (1 << 30) - RESERVE_BYTES - (64 << 20)  # a tiny model's step takes little
    assert greedy(eng) == want


@pytest.mark.parametrize("eager", [True, False])
def test_deterministic_bf16_tokens_do_not_depend_on_the_batch(eager):
    """On the Triton kernels (attention, projections, RMS norm) a request's greedy bf16 tokens are the
    same alone and beside others, with chunked prompts, eager and through the CUDA graphs."""
    eng = engine("cuda", eager=eager, dtype="bfloat16", deterministic=True, max_num_batched_tokens=24, prefill_chunk_size=16)
    assert eng.model.kernel_variant.startswith("batch-invariant bfloat16 triton")
    together = greedy(eng, 16)
    alone = []
    for p in PROMPTS:
        solo = engine("cuda", eager=eager, dtype="bfloat16", deterministic=True, max_num_batched_tokens=24, prefill_chunk_size=16)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        r = solo.add_request(p, params)
        while solo.has_unfinished():
            solo.step()
        alone.append(r.output_token_ids)
    assert together == alone


@pytest.mark.parametrize("kw", [dict(mode="colocated", depth=2), dict(mode="disaggregated", prompt_depth=1, token_depth=1),
                                dict(mode="colocated", depth=2, swapping=True)],
                         ids=["colocated-2", "disagg-1-1", "colocated-2-swapping"])
def test_every_layout_on_cuda_gives_the_cpu_engines_tokens(tiny_ckpt_dir, kw):
    """Worker processes on the GPU (KV streamed between them, swapped through pinned host memory)
    give the float32 tokens of the CPU engine."""
    pytest.importorskip("zmq")  # (the lent GPU machine needs it carried in: scripts/gpu_check.sh)
    from dataclasses import replace

    from test_controller import LENGTHS, PROMPTS, _cfg, reference, serve

    cfg = _cfg(tiny_ckpt_dir, **kw)
    cfg = replace(cfg, engine=replace(cfg.engine, device="cuda"))
    results, stats, free = serve(cfg, PROMPTS, LENGTHS)
    assert [toks for toks, _ in results] == reference(PROMPTS, LENGTHS)
    assert free == [128] * len(free), "KV blocks leaked"


def test_hidden_states_between_gpu_stages_go_through_the_page_locked_ring(tiny_ckpt_dir):
    """Two stages on the GPU pass hidden states through the shared-memory ring (registered with the
    driver where it can be) and give the CPU engine's float32 tokens."""
    pytest.importorskip("zmq")
    from test_controller import check_hidden_states

    check_hidden_states(tiny_ckpt_dir, ring=True, device="cuda")


@pytest.mark.parametrize("kw, victim", [(dict(mode="colocated", depth=2), "colocated-1"),
                                        (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0")],
                         ids=["colocated-2:replica", "disagg-1-1:token"])
def test_a_killed_gpu_worker_is_replaced_and_no_token_changes(tiny_ckpt_dir, kw, victim):
    """Recovery on CUDA: a SIGKILLed worker's replacement (a new CUDA context) restores or recomputes,
    and every stream ends with the tokens of a run without the failure."""
    pytest.importorskip("zmq")
    from dataclasses import replace

    from test_recovery import _cfg, reference, run_with_failure

    cfg = _cfg(tiny_ckpt_dir, **kw)
    cfg = replace(cfg, engine=replace(cfg.engine, device="cuda"))
    expected = reference()
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, victim, "kill", 20,
                                                                        replicated=kw["mode"] == "colocated")
    assert failures == 1 and recoveries == 1 and healthy
    assert streamed == expected and [f.token_ids for f in finals] == expected


def test_host_and_disk_tiers_on_cuda_give_the_cpu_engines_tokens(tmp_path):
    """KV blocks evicted from the GPU to pinned host memory and on to disk, and brought back (`TierStore`
    through `Staging`: packed on the device, copied on a side stream), give the CPU engine's tokens."""
    from tier_waves import TBS, engine_waves

    reference = engine_waves(on=False)[0]
    outs, eng = engine_waves(True, 3, 16, str(tmp_path), device="cuda")
    assert outs == reference
    assert eng.kv_manager.tier_stats()["disk"].hits >= 3 * TBS and eng.runner.tiers.moved["from_disk"][0] > 0


def test_kv_pulled_between_gpu_engines_gives_the_cpu_engines_tokens(tiny_ckpt_dir):
    """The router's P/D pools on CUDA: a prompt's blocks copied out of one GPU engine's cache beside its engine
    thread, pulled over HTTP into another's host tier and promoted to its GPU: the CPU engine's float32 tokens."""
    pytest.importorskip("fastapi")  # (carried in on the lent GPU machine: scripts/gpu_check.sh)
    import httpx

    from kvflow.api.server import BackgroundServer
    from kvflow.serving.backend import EngineBackend
    from streaming.test_kv_pull import GREEDY, PROMPT, engine as pull_engine, generate

    want = generate(pull_engine(tiny_ckpt_dir), PROMPT)
    with BackgroundServer(EngineBackend(pull_engine(tiny_ckpt_dir, device="cuda"), "tiny")) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}, timeout=120)
        assert r.status_code == 200, r.text
        eng = pull_engine(tiny_ckpt_dir, host_blocks=8, device="cuda")
        assert generate(eng, PROMPT, GREEDY, kv_source=srv.url) == want
        assert eng.kv_manager.pulled == [0, 5] and eng.kv_manager.tier_stats()["host"].hits == 5 * 16


def test_a_pipelines_pool_is_sized_from_what_its_stages_measured_on_the_gpu(tiny_ckpt_dir):
    """gpu_memory_utilization in a pipeline mode: the two stages of a colocated pipeline (on this one
    GPU) load their layers, measure and report; the pool is what their reports leave
    (`pipeline_pools`), every stage holds it, everything on the GPU stays under the fraction, and the
    tokens are the CPU engine's."""
    pytest.importorskip("zmq")
    import asyncio

    from test_controller import LENGTHS, PROMPTS, _cfg, _collect, reference

    from kvflow.controller.controller import Controller
    from kvflow.engine.memory import pipeline_pools

    # 4 GiB over what is held now: two workers' contexts, steps, reserves and KV
    cfg = _sized_cfg(_cfg(tiny_ckpt_dir, mode="colocated", depth=2, replication="none"))
    util, total = cfg.engine.gpu_memory_utilization, torch.cuda.mem_get_info()[1]

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            pool = ctrl.pipelines[0].kv_manager.num_blocks
            results = await asyncio.gather(*[_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))])
            held = total - torch.cuda.mem_get_info()[0]  # both workers' weights, KV, graphs and steps, and this process
            return ctrl.measured, pool, results, held, ctrl.pipelines[0].kv_manager.num_free_blocks
        finally:
            await ctrl.shutdown()

    measured, pool, results, held, free_blocks = asyncio.run(main())
    assert sorted(measured) == ["colocated-0", "colocated-1"]
    assert len({m.device for m in measured.values()}) == 1  # one GPU: they shared it
    assert all(m.block_bytes == 2 * 4 * 2 * 16 * 4 and m.activations > 0 for m in measured.values())  # K+V, 1 layer, fp32
    assert pool == pipeline_pools({n: ("colocated", m) for n, m in measured.items()}, util)["colocated"] > 0
    assert held <= util * total, f"{held / 2**30:.2f} GiB held on the GPU, over {util} of it"
    assert [toks for toks, _ in results] == reference(PROMPTS, LENGTHS)
    assert free_blocks == pool, "KV blocks leaked"


def _sized_cfg(cfg):
    """`cfg` on this GPU with its pools sized from memory: 4 GiB over what is held now (this process's
    context counts as in use, as another process's would)."""
    from dataclasses import replace

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = (total - free + (4 << 30)) / total
    return replace(cfg, engine=replace(cfg.engine, device="cuda", num_kv_blocks=None, gpu_memory_utilization=util))


def test_a_replacement_stage_takes_the_live_pool_when_it_fits(tiny_ckpt_dir):
    """A killed stage of a pipeline sized from GPU memory: its replacement measures, the pipeline's pool
    fits what the dead one left, and the streams end with the tokens of a run without the failure."""
    pytest.importorskip("zmq")
    from test_recovery import _cfg, reference, run_with_failure

    cfg = _sized_cfg(_cfg(tiny_ckpt_dir, mode="colocated", depth=2, replication="none"))
    expected = reference()
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, "colocated-1", "kill", 20)
    assert failures == 1 and recoveries == 1 and healthy
    assert streamed == expected and [f.token_ids for f in finals] == expected


def test_a_replacement_that_cannot_fit_the_live_pool_says_so(tiny_ckpt_dir, caplog):
    """With the GPU's fraction taken by another holder (this process) after the start, a killed stage's
    replacement has no room for the pipeline's pool, which cannot change: each attempt fails with that
    error, and the controller gives up."""
    pytest.importorskip("zmq")
    import asyncio
    import logging

    from test_recovery import _cfg

    from kvflow.controller.controller import Controller

    cfg = _sized_cfg(_cfg(tiny_ckpt_dir, mode="colocated", depth=2, replication="none", max_restarts=2))
    caplog.set_level(logging.ERROR, logger="kvflow.controller.recovery")

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            free, total = torch.cuda.mem_get_info()
            hog = torch.empty(int(cfg.engine.gpu_memory_utilization * total) - (total - free) + (256 << 20), dtype=torch.uint8,
                              device="cuda")  # everything the fraction has left, and a little more
            ctrl.stages["colocated-1"].process.kill()
            for _ in range(3000):  # (an event: the controller's failure, polled; the bound only stops a hang)
                if ctrl.failure is not None:
                    break
                await asyncio.sleep(0.1)
            del hog
            return ctrl.failure
        finally:
            await ctrl.shutdown()

    failure = asyncio.run(main())
    assert failure is not None and "its replacement failed 2 times" in failure
    errors = [r.getMessage() for r in caplog.records if "replacing colocated-1 failed" in r.getMessage()]
    assert len(errors) == 2 and all("does not fit on its GPU" in e and "cannot change a live pipeline's pool" in e
                                    for e in errors), errors

"""Engine and scheduler: continuous batching, chunked prefill, admission, preemption, stop conditions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.sched.sampling import SamplingParams

from conftest import run_to_completion, tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 70))]


def _generate(engine, prompts, params=GREEDY):
    reqs = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    return [final[r.request_id].token_ids for r in reqs]


def _solo(prompts, params=GREEDY, **kw):
    return [_generate(tiny_engine(**kw), [p], params)[0] for p in prompts]


def test_continuous_batch_equals_one_request_at_a_time():
    assert _generate(tiny_engine(), PROMPTS) == _solo(PROMPTS)


def test_requests_join_a_running_batch_and_leave_it():
    eng = tiny_engine()
    a = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    b = eng.add_request(PROMPTS[1], GREEDY)  # joins while a is decoding
    out = eng.scheduler.schedule()
    assert {s.request.request_id for s in out.seqs} == {a.request_id, b.request_id}
    eng.scheduler.update(out, eng.runner.run(out))
    run_to_completion(eng)
    assert a.is_finished and b.is_finished and len(a.output_token_ids) == 3
    assert a.output_token_ids == _solo(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert b.output_token_ids == _solo(PROMPTS[1:2])[0]


def test_long_prompt_is_chunked_and_does_not_stall_decodes():
    eng = tiny_engine(max_num_batched_tokens=8, prefill_chunk_size=8, num_kv_blocks=128)
    short = [eng.add_request(p, GREEDY) for p in ([5, 6], [7, 8])]
    for _ in range(2):
        eng.step()
    long_req = eng.add_request(list(range(3, 83)), GREEDY)  # 80 tokens = 10+ chunks
    steps = 0
    while not long_req.output_token_ids:
        out = eng.scheduler.schedule()
        by_id = {s.request.request_id: s.num_new_tokens for s in out.seqs}
        assert out.num_tokens <= 8
        for r in short:
            if not r.is_finished:
                assert by_id.get(r.request_id) == 1, "a running decode was skipped for a prompt chunk"
        assert by_id.get(long_req.request_id, 0) <= 8
        eng.scheduler.update(out, eng.runner.run(out))
        steps += 1
    assert steps >= 80 // 6
    run_to_completion(eng)
    assert long_req.output_token_ids == _solo([list(range(3, 83))])[0]


def test_request_that_can_never_fit_is_rejected_and_one_that_cannot_fit_now_waits():
    eng = tiny_engine(num_kv_blocks=10, block_size=4)  # 40 tokens of KV
    with pytest.raises(ValueError, match="needs up to 11 KV blocks"):
        eng.add_request(list(range(30)), SamplingParams(max_tokens=12))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request(list(range(3, 50)) * 6, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds this model's maximum context length"):
        eng.add_request([3, 4], SamplingParams(max_tokens=255))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([3, 96], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    a = eng.add_request(list(range(3, 31)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # 28 tok = 7 blocks
    b = eng.add_request(list(range(3, 23)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # 5 blocks: waits
    eng.step()
    assert a.block_ids and not b.block_ids and b in eng.scheduler.waiting
    final = run_to_completion(eng)
    assert final[a.request_id].finish_reason == "length" and final[b.request_id].finish_reason == "length"
    assert eng.kv_manager.num_free_blocks == 10


def test_preemption_recomputes_and_gives_identical_tokens():
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 15)), list(range(20, 32)), list(range(40, 52))]
    # 64 token slots for 3 x 36 tokens: admitted greedily they must preempt; with the KV reservation
    # (the default) they run one after the other and none is preempted; the tokens are the same
    for reserve in (False, True):
        eng = tiny_engine(num_kv_blocks=16, block_size=4, reserve_kv=reserve)
        reqs = [eng.add_request(p, params) for p in prompts]
        final = run_to_completion(eng)
        assert (sum(r.num_preemptions for r in reqs) > 0) is not reserve
        assert [final[r.request_id].token_ids for r in reqs] == _solo(prompts, params)
        assert eng.kv_manager.num_free_blocks == 16
        eng.kv_manager.pool.check()


def test_sampling_with_seed_is_reproducible_whatever_the_batch():
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = _generate(tiny_engine(), [PROMPTS[1]], p)[0]
    others = SamplingParams(max_tokens=7, temperature=0.8, seed=7, ignore_eos=True)
    eng = tiny_engine()
    eng.add_request(PROMPTS[0], others)
    r = eng.add_request(PROMPTS[1], p)
    eng.add_request(PROMPTS[2], SamplingParams(max_tokens=5, temperature=1.3, ignore_eos=True))
    assert run_to_completion(eng)[r.request_id].token_ids == alone
    other_seed = _generate(tiny_engine(), [PROMPTS[1]], SamplingParams(**{**p.__dict__, "seed": 99}))[0]
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_are_greedy():
    greedy = _generate(tiny_engine(), [PROMPTS[3]])[0]
    assert _generate(tiny_engine(), [PROMPTS[3]], SamplingParams(max_tokens=12, temperature=5.0, top_k=1, ignore_eos=True))[0] == greedy
    assert _generate(tiny_engine(), [PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-6, seed=3, ignore_eos=True))[0] == greedy


def test_stop_token_ids_eos_min_tokens_and_max_tokens():
    greedy = _generate(tiny_engine(), [PROMPTS[4]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_tok = greedy[4]
    first = greedy.index(stop_tok)
    e = tiny_engine()
    r = e.add_request(PROMPTS[4], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_tok,)))
    res = run_to_completion(e)[r.request_id]
    assert res.finish_reason == "stop" and res.token_ids == greedy[: first + 1]
    # the same id treated as EOS by the model config
    from conftest import tiny_config

    e = tiny_engine(cfg=tiny_config(eos_token_ids=(stop_tok,)))
    r = e.add_request(PROMPTS[4], SamplingParams(max_tokens=12, temperature=0))
    assert run_to_completion(e)[r.request_id].token_ids == greedy[: first + 1]
    e = tiny_engine(cfg=tiny_config(eos_token_ids=(stop_tok,)))
    r = e.add_request(PROMPTS[4], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    res = run_to_completion(e)[r.request_id]
    assert res.token_ids == greedy and res.finish_reason == "length"
    # min_tokens bans the stop id until enough tokens exist
    e = tiny_engine()
    r = e.add_request(PROMPTS[4], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_tok,), min_tokens=first + 1))
    res = run_to_completion(e)[r.request_id]
    assert stop_tok not in res.token_ids[: first + 1] and len(res.token_ids) > first + 1


def test_abort_frees_blocks_and_reports_nothing_more():
    eng = tiny_engine(num_kv_blocks=32)
    r = eng.add_request(PROMPTS[1], GREEDY)
    eng.step()
    assert eng.kv_manager.num_free_blocks < 32
    eng.abort_request(r.request_id)
    assert r.finish_reason == "abort" and eng.kv_manager.num_free_blocks == 32 and not eng.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(min_tokens=20, max_tokens=5), "min_tokens"),
    ],
)
def test_bad_sampling_params_rejected(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_engine_rejects_bad_requests():
    eng = tiny_engine()
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("text prompt", GREEDY)
    with pytest.raises(ValueError, match="string or a list of token ids"):
        eng.add_request([1.5, 2], GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request([3, 4], SamplingParams(stop=("x",)))
    eng.add_request([3, 4], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([3, 4], GREEDY, request_id="dup")


def test_dtype_auto_resolves_once_to_bf16_only_with_native_bf16():
    from kvflow.config import EngineConfig, native_bf16, resolve_dtype

    assert resolve_dtype("float32") == ("float32", "requested")
    dtype, why = resolve_dtype("auto")
    assert dtype == ("bfloat16" if native_bf16("cpu") else "float32") and why.startswith("auto")
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    assert (native_bf16("cpu") is not None) == ("avx512_bf16" in flags or "amx_bf16" in flags)
    assert EngineConfig(dtype="auto").dtype == dtype  # concrete from then on: what workers receive
    assert EngineConfig().dtype == "float32"  # hand-built engines keep the reference dtype


def _huge_kb(env_value: str | None) -> tuple[int, int, int]:
    """In a fresh process that imports kvflow, then torch: AnonHugePages (kB) after filling a 64 MB
    tensor, the resident kB a 64 MB KV cache adds when made, and the AnonHugePages it adds when filled."""
    code = ("import kvflow, torch\n"
            "from kvflow.kv.cache import KVCache, KVLayout\n"
            "def kb(key): return int(next(l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith(key)))\n"
            "x = torch.ones(16 << 20); huge, rss = kb('AnonHugePages'), kb('Rss')\n"
            "kv = KVCache(KVLayout(num_blocks=32, block_size=16, num_kv_heads=16, head_dim=64, layer_start=0, layer_end=16))\n"
            "made = kb('Rss') - rss; assert not kv.data.any(); kv.data.fill_(1.0)\n"
            "print(huge, made, kb('AnonHugePages') - huge)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    huge, made, kv_huge = map(int, out.split())
    return huge, made, kv_huge


def test_large_tensors_on_transparent_huge_pages():
    """Importing kvflow puts torch's large CPU allocations and the KV cache (a lazily zeroed mapping,
    resident only where touched) on transparent huge pages (madvised), and THP_MEM_ALLOC_ENABLE=0 from
    the user turns that off."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not Path("/proc/self/smaps_rollup").exists() or not mode.exists() or "[madvise]" not in mode.read_text():
        pytest.skip("needs Linux with transparent huge pages in madvise mode")
    huge, made, kv_huge = _huge_kb(None)
    assert huge >= 2048  # at least one 2 MB page of the 64 MB (the rest may fall back under fragmentation)
    assert kv_huge >= 2048 and made < 8 << 10  # 64 MB of zeros, not one page of it written at start
    huge, made, kv_huge = _huge_kb("0")
    assert huge == 0 and kv_huge == 0 and made < 8 << 10

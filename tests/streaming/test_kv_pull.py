"""Pulling a prompt's KV blocks from another instance (`kvflow.streaming.kv_pull`): a real engine served over HTTP
as the source, a second engine with a host tier pulling from it before admission."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from kvflow.api.server import APIConfig, BackgroundServer
from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.kv.cache import KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.sched.sampling import SamplingParams
from kvflow.serving.backend import EngineBackend
from kvflow.streaming.kv_pull import PULL_PATH, KVPuller, geometry
from conftest import run_to_completion, tiny_config

BS = 16
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(5 * BS + 5)]  # 5 full blocks and 5 tokens
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine(ckpt, host_blocks: int = 0, device: str = "cpu") -> LLMEngine:
    bpb = KVLayout.for_model(tiny_config(), 1, BS).bytes_per_block
    return LLMEngine.from_config(EngineConfig(model=str(ckpt), block_size=BS, num_kv_blocks=64, device=device,
                                              host_kv_bytes=host_blocks * bpb))


def generate(eng: LLMEngine, prompt, params=GREEDY, kv_source=None) -> list[int]:
    req = eng.add_request(prompt, params, kv_source=kv_source)
    return run_to_completion(eng)[req.request_id].token_ids


@pytest.fixture(scope="module")
def source(tiny_ckpt_dir):
    """An engine behind the HTTP API that has run PROMPT (its full blocks are in its prefix cache)."""
    backend = EngineBackend(engine(tiny_ckpt_dir), "tiny")
    with BackgroundServer(backend, config=APIConfig(api_key="k3y")) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
                       headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert r.status_code == 200, r.text
        yield srv.url, backend


@pytest.fixture(scope="module")
def reference(tiny_ckpt_dir):
    return generate(engine(tiny_ckpt_dir), PROMPT)


def test_pulled_blocks_give_the_same_tokens(tiny_ckpt_dir, source, reference):
    url, _ = source
    eng = engine(tiny_ckpt_dir, host_blocks=8)
    eng.runner.tiers.puller.api_key = "k3y"
    assert generate(eng, PROMPT, kv_source=url) == reference
    kv = eng.kv_manager
    assert kv.pulled == [0, 5]  # every full block came from the source ...
    assert kv.tier_stats()["host"].hits == 5 * BS  # ... through the host tier into the device pool
    kv.pool.check()
    kv.host.check()


def test_requests_wait_for_their_pull_while_others_run(tiny_ckpt_dir, source):
    """A pull runs in the background: the engine keeps stepping, and a request whose blocks are still coming is not
    admitted before they are here (the pull is held back until the engine has stepped past its planning)."""
    url, backend = source
    prompts = [PROMPT[:3 * BS] + [(5 * i + k) % 90 + 1 for i in range(2 * BS + 3)] for k in range(4)]
    for p in prompts:
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 1},
                          headers={"Authorization": "Bearer k3y"}, timeout=60).status_code == 200
    want = [generate(engine(tiny_ckpt_dir), p) for p in prompts]
    eng = engine(tiny_ckpt_dir, host_blocks=32)
    puller = eng.runner.tiers.puller
    puller.api_key = "k3y"
    release, real_pull = threading.Event(), puller.pull

    def held_pull(src, hashes):
        release.wait(60)
        return real_pull(src, hashes)

    puller.pull = held_pull
    other = eng.add_request(PROMPT[:BS + 3], GREEDY)  # no source: runs while the pulls wait
    reqs = [eng.add_request(p, GREEDY, kv_source=url) for p in prompts]
    for _ in range(5):
        eng.step()
    assert eng.runner.tiers.pulling and all(r.num_computed_tokens == 0 for r in reqs) and other.num_computed_tokens > 0
    release.set()
    final = run_to_completion(eng)
    assert [final[r.request_id].token_ids for r in reqs] == want
    stats = eng.kv_manager.tier_stats()
    assert eng.kv_manager.pulled == [0, 3 + 4 * 2]  # the 3 shared blocks once, then each prompt's own 2
    assert stats["host"].hits + stats["device"].hits == 4 * 5 * BS  # every full block pulled or shared: none computed


def test_blocks_the_source_lacks_are_recomputed(tiny_ckpt_dir, source):
    url, _ = source
    other = PROMPT[:2 * BS] + [5] * (3 * BS)  # 4 full blocks before the last token: the source holds the first two
    want = generate(engine(tiny_ckpt_dir), other)
    eng = engine(tiny_ckpt_dir, host_blocks=8)
    eng.runner.tiers.puller.api_key = "k3y"
    assert generate(eng, other, kv_source=url) == want
    assert eng.kv_manager.pulled == [2, 2]  # [not there, landed]


def test_one_pull_for_two_requests_brings_each_what_the_source_holds(tiny_ckpt_dir, source, reference):
    """Two requests' blocks in one pull: the first request's missing tail does not cost the second its blocks."""
    url, _ = source
    other = PROMPT[:2 * BS] + [5] * (3 * BS)  # the source holds its first two full blocks of four
    want = generate(engine(tiny_ckpt_dir), other)
    eng = engine(tiny_ckpt_dir, host_blocks=16)
    eng.runner.tiers.puller.api_key = "k3y"
    a, b = eng.add_request(other, GREEDY, kv_source=url), eng.add_request(PROMPT, GREEDY, kv_source=url)
    final = run_to_completion(eng)
    assert [final[a.request_id].token_ids, final[b.request_id].token_ids] == [want, reference]
    assert eng.kv_manager.pulled == [2, 2 + 3]  # other's two shared blocks (once), PROMPT's own three; other's tail not
    stats = eng.kv_manager.tier_stats()
    assert stats["host"].hits + stats["device"].hits == (2 + 5) * BS  # other's 2 blocks, PROMPT's 5: none computed


def test_an_unreachable_or_refusing_source_costs_only_the_recompute(tiny_ckpt_dir, source, reference):
    url, _ = source
    for src, key in ((url, "wrong key"), ("http://127.0.0.1:9", None)):
        eng = engine(tiny_ckpt_dir, host_blocks=8)
        eng.runner.tiers.puller.api_key = key
        assert generate(eng, PROMPT, kv_source=src) == reference
        assert eng.kv_manager.pulled == [5, 0]
        eng.kv_manager.host.check()


def test_without_a_host_tier_the_source_is_ignored(tiny_ckpt_dir, source, reference):
    eng = engine(tiny_ckpt_dir)
    assert generate(eng, PROMPT, kv_source=source[0]) == reference
    assert eng.kv_manager.pulled == [0, 0]


def test_bad_pulls_are_refused(source):
    url, backend = source
    layout = backend.engine.kv_cache.layout
    h = {"Authorization": "Bearer k3y"}
    good = {"hashes": ["ab" * 32], "geometry": geometry(layout)}
    assert httpx.post(url + PULL_PATH, json=good, headers=h).status_code == 204  # well formed, held nowhere
    assert httpx.post(url + PULL_PATH, json=good).status_code == 401
    bad = [b"not json", json.dumps({"hashes": ["zz"], "geometry": geometry(layout)}).encode(),
           json.dumps({"hashes": [], "geometry": geometry(layout)}).encode(),
           json.dumps({"hashes": ["ab"] * 5000, "geometry": geometry(layout)}).encode(),
           json.dumps({"hashes": ["ab" * 32], "geometry": {**geometry(layout), "block_size": 32}}).encode(),
           json.dumps({"hashes": ["ab", "abcd"], "geometry": geometry(layout)}).encode(),
           json.dumps({"hashes": ["ab"], "geometry": geometry(layout), "more": 1}).encode()]
    for body in bad:
        r = httpx.post(url + PULL_PATH, content=body, headers=h)
        assert r.status_code in (400, 413), (body[:60], r.status_code, r.text)


def test_a_puller_rejects_an_answer_of_another_geometry(source):
    url, backend = source
    lay = backend.engine.kv_cache.layout
    hashes = backend.engine.kv_manager.pool.hash_of
    from dataclasses import replace

    with pytest.raises(ConnectionError, match="400"):  # the source refuses a pull of blocks of another size
        KVPuller(replace(lay, block_size=2 * BS), "k3y").pull(url, list(hashes.values())[:1])


def test_the_source_sends_what_it_holds_and_not_a_block_evicted_while_copied():
    """`read_blocks`: every named block the pool holds, gaps included (one pull may carry several requests' blocks),
    their positions in the chunk's meta; a block evicted while the blocks were copied (outside the engine thread) is
    left out."""
    from kvflow.kv.cache import KVCache
    from kvflow.streaming.kv_pull import read_blocks
    from kvflow.streaming.primitives import verify
    from kvflow.streaming.transports.file import parse_frame

    lay = KVLayout.for_model(tiny_config(), 4, 2)
    cache = KVCache(lay)
    cache.data.normal_()
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tokens, hashes, table = [1, 2, 3, 4, 5, 6, 7], [], []
    assert kv.ensure(table, 7)
    kv.cache_blocks(table, tokens, hashes, 0, 7)
    blocks = list(table)
    kv.release(table)  # cached: the last block is evicted first

    def sent(names):
        chunk = verify(parse_frame(bytearray(b"".join(read_blocks(cache, kv, names))), "test"))
        held = chunk.header.meta["held"]
        want = cache.data[:, :, [blocks[hashes.index(names[i])] for i in held]].reshape(chunk.data.shape)
        assert torch.equal(chunk.data, want)
        return held

    assert sent([b"x" * 16, hashes[0], hashes[1]]) == [1, 2]  # a gap does not stop the rest
    real = kv.still_held

    def evicting(names, held):  # the engine thread evicts a block while the source copies
        other: list[int] = []
        assert kv.ensure(other, 4)  # the free block and one cached: the last block of the prefix
        return real(names, held)

    kv.still_held = evicting
    assert sent(hashes) == [0, 1]
    assert kv.held_blocks(hashes) == [(0, blocks[0], 0), (1, blocks[1], 0)]
    assert kv.pool.generation[blocks[2]] == 1

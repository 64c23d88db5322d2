"""Decode steps through `DecodeGraphs`: its packed, padded buffers give the ordinary forward's logits
and the engine's tokens. On CUDA the steps replay captured graphs; on the CPU the same buffers feed
the forward eagerly, so CI checks the bookkeeping (packing, padding to a bucket, the batch over the
buffers) that a captured graph depends on."""

from __future__ import annotations

import pytest
import torch
from conftest import run_to_completion, tiny_cache, tiny_config, tiny_engine, tiny_model

from kvflow.engine.cuda_graphs import DecodeGraphs
from kvflow.kv.cache import KVCache
from kvflow.model.batch import ForwardBatch
from kvflow.sched.sampling import SamplingParams

def test_a_padded_bucket_gives_the_ordinary_forwards_logits():
    """Three decode rows (a bucket of 4: one spare row) over prompts already in the cache."""
    cfg = tiny_config()
    model, cache = tiny_model(cfg), tiny_cache(cfg, num_blocks=32, block_size=4)
    prompts = [[3, 9, 27], [4, 11, 5, 6, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    blocks = [[5, 2], [9, 0], [30, 7, 21]]  # scattered, each with room for one more token
    model.forward(torch.tensor([t for p in prompts for t in p]),
                  ForwardBatch.of([(len(p), len(p), b) for p, b in zip(prompts, blocks)], 4), cache)
    tokens = [40, 41, 42]
    contexts = [(len(p) + 1, b) for p, b in zip(prompts, blocks)]
    cache_copy = KVCache(cache.layout)
    cache_copy.data.copy_(cache.data)
    want = model.forward(torch.tensor(tokens), ForwardBatch.of([(1, c, b) for c, b in contexts], 4), cache_copy)
    graphs = DecodeGraphs(model, cache, max_batch=8, max_model_len=64, buckets=(1, 4, 8), capture=False)
    assert graphs.bucket(3) == 4
    got = graphs.run(tokens, contexts)
    assert got.shape == (3, cfg.vocab_size)
    assert torch.equal(got, want)
    assert torch.equal(cache.data, cache_copy.data)  # the spare row wrote nothing else


def test_the_engine_gives_the_same_tokens_through_the_decode_buffers():
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 3, 40] * 2, [8, 1, 2], [30, 31, 32, 33, 34, 35, 36]]

    def tokens(graphed: bool):
        eng = tiny_engine(num_kv_blocks=64, block_size=4)
        if graphed:
            eng.runner.graphs = DecodeGraphs(eng.model, eng.kv_cache, max_batch=4, max_model_len=eng.max_model_len,
                                             buckets=(1, 2, 4), capture=False)
            calls = []
            run = eng.runner.graphs.run
            eng.runner.graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
        ids = [eng.add_request(p, params).request_id for p in prompts]
        done = run_to_completion(eng)
        if graphed:
            assert calls and set(calls) == {3}  # every decode step went through the buffers
        return [done[r].token_ids for r in ids]

    assert tokens(True) == tokens(False)


def test_bad_input_is_refused():
    eng = tiny_engine(num_kv_blocks=16, block_size=4)
    graphs = DecodeGraphs(eng.model, eng.kv_cache, max_batch=2, max_model_len=16, capture=False)
    with pytest.raises(ValueError, match="1..2"):
        graphs.bucket(3)
    with pytest.raises(ValueError, match="blocks"):
        graphs.run([1], [(9, [0, 1])])  # 9 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(eng.model, eng.kv_cache, max_batch=2, max_model_len=16, capture=True)

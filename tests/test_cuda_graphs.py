"""Decode steps through `DecodeGraphs`: its packed, padded buffers give the ordinary forward's logits
and the engine's tokens. On CUDA the steps replay captured graphs; on the CPU the same buffers feed
the forward eagerly, so CI checks the bookkeeping (packing, padding to a bucket, the batch over the
buffers) that a captured graph depends on."""

from __future__ import annotations

import pytest
import torch
from conftest import run_to_completion, tiny_cache, tiny_config, tiny_engine, tiny_model

from kvflow.model.cuda_graphs import DecodeGraphs
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
    got = graphs.run(contexts, tokens=tokens)
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
            eng.runner.graphs.run = lambda contexts, **kw: calls.append(len(contexts)) or run(contexts, **kw)
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
        graphs.run([(9, [0, 1])], tokens=[1])  # 9 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match="first stage takes tokens"):
        graphs.run([(3, [0])], hidden=torch.zeros(1, eng.model.cfg.hidden_size))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(eng.model, eng.kv_cache, max_batch=2, max_model_len=16, capture=True)


def test_two_stages_through_their_buffers_give_the_whole_models_logits():
    """A pipeline's stages (layers [0, 1) and [1, 2)): token ids -> hidden states -> logits through
    each stage's buffers, against the whole model's forward."""
    cfg = tiny_config()
    from conftest import tiny_state_dict

    from kvflow.model.llama import LlamaModel

    sd = tiny_state_dict(cfg)
    whole = LlamaModel.from_state_dict(cfg, sd)
    first, last = (LlamaModel.from_state_dict(cfg, sd, layer_range=r) for r in ((0, 1), (1, 2)))
    caches = [tiny_cache(cfg, 32, 4), tiny_cache(cfg, 32, 4, layer_range=(0, 1)), tiny_cache(cfg, 32, 4, layer_range=(1, 2))]
    prompts, blocks = [[3, 9, 27, 5], [4, 11]], [[7, 2], [9]]
    ids = torch.tensor([t for p in prompts for t in p])
    batch = ForwardBatch.of([(len(p), len(p), b) for p, b in zip(prompts, blocks)], 4)
    whole.forward(ids, batch, caches[0])
    last.logits(last.run_layers(first.run_layers(first.embed(ids), batch, caches[1]), batch, caches[2]), batch)
    contexts = [(len(p) + 1, b) for p, b in zip(prompts, blocks)]
    want = whole.forward(torch.tensor([40, 41]), ForwardBatch.of([(1, c, b) for c, b in contexts], 4), caches[0])
    g0 = DecodeGraphs(first, caches[1], max_batch=4, max_model_len=32, capture=False)
    g1 = DecodeGraphs(last, caches[2], max_batch=4, max_model_len=32, capture=False, float_logits=False)
    hidden = g0.run(contexts, tokens=[40, 41])
    assert hidden.shape == (2, cfg.hidden_size)
    assert torch.equal(g1.run(contexts, hidden=hidden), want)


@pytest.mark.parametrize("kw", [dict(mode="colocated", depth=2), dict(mode="disaggregated", prompt_depth=1, token_depth=2),
                                dict(mode="colocated", depth=2, swapping=True)],
                         ids=["colocated-2", "disagg-1-2", "colocated-2-swapping"])
def test_pipeline_stages_through_their_decode_buffers_give_the_engines_tokens(tiny_ckpt_dir, kw, monkeypatch):
    """Worker processes whose decode steps go through `DecodeGraphs` (first stage: token ids, later
    stages: hidden states, last: logits), eagerly on the CPU as they replay on CUDA."""
    from test_controller import LENGTHS, PROMPTS, _cfg, reference, serve

    expected = reference(PROMPTS, LENGTHS)  # (the engine of this process: before the switch)
    monkeypatch.setenv("KVFLOW_TEST_DECODE_BUFFERS", "1")
    results, stats, free = serve(_cfg(tiny_ckpt_dir, **kw), PROMPTS, LENGTHS)
    assert [toks for toks, _ in results] == expected
    assert free == [128] * len(free)

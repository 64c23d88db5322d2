"""The real default model (SmolLM2-135M): streaming its KV while decoding, to another process over
TCP and to the file store, changes no token and the destination's KV equals the source's."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvflow.config import EngineConfig

from kvflow.engine.engine import LLMEngine
from kvflow.sched.sampling import SamplingParams
from kvflow.model.llama import LlamaModel
from kvflow.model.loader import load_checkpoint
from kvflow.model.tokenizer import Tokenizer
from kvflow.streaming.connector import KVSender
from kvflow.streaming.primitives import InStream, OutStream
from kvflow.streaming.scatter import gather
from kvflow.streaming.transports import FileReceiver, FileSender, TcpSender
from kvhelpers import new_sink, receiver_process, seq_kv, stream_engine

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Write a haiku about the sea."]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    ck = load_checkpoint(None)
    return LlamaModel.from_state_dict(ck.config, ck.state_dict), Tokenizer(ck.directory)


def run(model, tok, streamer_for=None):
    engine = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=16))
    streamer = streamer_for(engine) if streamer_for else None
    if streamer:
        streamer.tables = stream_engine(engine, streamer)
    lens = {}
    for i, p in enumerate(PROMPTS):
        lens[f"p{i}"] = engine.add_request(p, PARAMS, request_id=f"p{i}").num_prompt_tokens + PARAMS.max_tokens - 1
    tokens = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
    if streamer:
        streamer.finish()
        streamer.close()
    return engine, streamer, tokens, lens


def test_real_model_streamed_over_tcp_and_to_file_store(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    _, _, reference, _ = run(model, tok)
    layers = range(model.cfg.num_layers)

    # 1) to another process over TCP, layer-by-layer + overlapped token streaming
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    layout = LLMEngine(model, tok, EngineConfig(num_kv_blocks=64, block_size=16)).kv_cache.layout
    proc = ctx.Process(target=receiver_process, args=("tcp", layout, child), daemon=True)
    proc.start()
    assert conn.poll(60)
    address = conn.recv()
    engine, streamer, tokens, lens = run(model, tok, lambda e: KVSender(e.kv_cache, 0, {0: OutStream(TcpSender(address, window=32))}, "overlap"))
    conn.send(streamer.outs[0].chunks_sent)
    assert conn.poll(120)
    remote = conn.recv()
    proc.join(10)
    streamer.outs[0].sender.close()
    assert tokens == reference
    for rid, n in lens.items():
        kv, mask = remote[rid]
        assert mask.shape[2] == n and mask.all()
        assert torch.equal(torch.from_numpy(kv), seq_kv(engine.kv_cache, streamer.tables[rid], 0, n, layers))

    # 2) to the file store (buffered per step), read back by a fresh reader
    store = tmp_path / "kv"
    engine, streamer, tokens, lens = run(model, tok, lambda e: KVSender(e.kv_cache, 0, {0: OutStream(FileSender(store))}, "buffered"))
    assert tokens == reference
    sink, tables = new_sink(layout)
    gather(InStream(FileReceiver(store)), sink, num_chunks=streamer.outs[0].chunks_sent, timeout=5)
    for rid, n in lens.items():
        assert sink.received[rid].shape[2] == n and sink.received[rid].all()
        assert torch.equal(seq_kv(sink.cache, tables[rid], 0, n, layers), seq_kv(engine.kv_cache, streamer.tables[rid], 0, n, layers))

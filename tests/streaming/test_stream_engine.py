"""Streaming a running engine's KV through the KV connector (naive / buffered / layer-by-layer +
overlap) and its receiver, and scatter pieces: tokens unchanged, destination KV equal to the source's."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvflow.sched.sampling import SamplingParams
from kvflow.kv.cache import KVLayout
from kvflow.kv.cache import KVCache
from kvflow.streaming.connector import KVReceiver, KVSender
from kvflow.streaming.errors import StreamingError
from kvflow.streaming.primitives import InStream, OutStream, fetch
from kvflow.streaming.region import KVRegion, contiguous_pieces
from kvflow.streaming.scatter import gather, scatter
from kvflow.streaming.transports import InprocChannel, TcpReceiver, TcpSender
from kvhelpers import new_sink, random_cache, random_seqs, seq_kv, stream_engine, tiny_engine

PROMPTS = [[5, 9, 11, 3, 7, 8, 1, 4, 6, 10, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36]]
PARAMS = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


def generate(engine) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, PARAMS, request_id=f"q{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
    return tokens


def receive_all(rx, layout, stop: threading.Event, result: dict) -> None:
    sink, tables = new_sink(layout)
    inp = InStream(rx)
    while not stop.is_set():
        try:
            with fetch(inp, 0.05) as chunk:
                sink.write(chunk)
        except TimeoutError:
            pass
    result.update(sink=sink, tables=tables)


@pytest.mark.parametrize("mode", ["naive", "buffered", "overlap"])
def test_streamed_engine_matches_and_destination_equals_source(mode):
    reference = generate(tiny_engine())
    engine = tiny_engine()
    rx = TcpReceiver()
    sender = KVSender(engine.kv_cache, 0, {0: OutStream(TcpSender(rx.address, window=16))}, mode=mode)
    src_tables = stream_engine(engine, sender)
    stop, result = threading.Event(), {}
    t = threading.Thread(target=receive_all, args=(rx, engine.kv_cache.layout, stop, result))
    t.start()
    engine.scheduler.config = type(engine.scheduler.config)(max_num_batched_tokens=8, prefill_chunk_size=8)  # chunked prefill too
    tokens = generate(engine)
    sender.finish()
    stop.set()
    t.join()
    sender.close()
    sender.outs[0].sender.close()
    rx.close()
    assert tokens == reference
    sink, tables = result["sink"], result["tables"]
    for i, p in enumerate(PROMPTS):
        rid = f"q{i}"
        n = len(p) + PARAMS.max_tokens - 1  # the last sampled token is never fed back
        assert sink.received[rid].shape[2] == n and sink.received[rid].all()
        src = seq_kv(engine.kv_cache, src_tables[rid], 0, n, range(4))
        assert torch.equal(src, seq_kv(sink.cache, tables[rid], 0, n, range(4)))


@pytest.mark.parametrize("coalesce", [0, 1 << 20])
def test_connector_receiver_reports_each_request_once_its_planned_kv_is_in(coalesce):
    # the worker-side pair the disaggregated server uses: KVSender (overlap) -> TCP -> KVReceiver;
    # coalesce 0: one chunk per layer; 1 MB: these small prompts' layers all go in one chunk per step
    engine = tiny_engine()
    dst = KVCache(engine.kv_cache.layout)
    rx = TcpReceiver()
    done, errors = [], []
    receiver = KVReceiver(dst, InStream(rx), lambda rids, spans: done.extend(rids), errors.append)
    receiver.start()
    sender = KVSender(engine.kv_cache, 0, {0: OutStream(TcpSender(rx.address))}, mode="overlap", coalesce_bytes=coalesce)
    src_tables = stream_engine(engine, sender)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=1, temperature=0), request_id=f"q{i}")
    steps = 0
    while engine.has_unfinished():
        engine.step()  # prompts only: each one is a whole hand-off of tokens [0, len)
        steps += 1
    sender.finish()
    layers = engine.kv_cache.layout.num_layers
    assert sender.chunks == (steps * layers if coalesce == 0 else steps)
    end = time.monotonic() + 30
    while len(done) < len(PROMPTS) and time.monotonic() < end:
        time.sleep(0.01)
    receiver.close()
    sender.close()
    assert sorted(done) == ["q0", "q1", "q2"] and not errors
    for i, p in enumerate(PROMPTS):
        rid = f"q{i}"
        assert torch.equal(seq_kv(engine.kv_cache, src_tables[rid], 0, len(p), range(4)), seq_kv(dst, src_tables[rid], 0, len(p), range(4)))


def test_background_failure_stops_the_engine():
    engine = tiny_engine()
    ch = InprocChannel(window=1, timeout=0.5)  # nobody consumes: the sender times out
    sender = KVSender(engine.kv_cache, 0, {0: OutStream(ch.sender)}, mode="overlap", pool_size=1, timeout=2)
    stream_engine(engine, sender)
    with pytest.raises(StreamingError, match="PeerTimeout|fell"):
        generate(engine)
    sender.close()


def test_naive_and_buffered_scatter_agree_and_coalesce():
    layout = KVLayout(40, 4, 2, 8, 2, 5)
    src = random_cache(layout, 4)
    seqs = random_seqs(random.Random(3), 40, 4, [13, 22, 3])
    region = KVRegion(tuple(seqs), 2, 5)
    pieces = contiguous_pieces(region, 4, coalesce=True)
    assert len(pieces) < len(contiguous_pieces(region, 4, coalesce=False))
    assert sum(p.length for p in pieces) == 2 * 3 * region.num_tokens
    got = []
    for mode, limit in [("naive", 1 << 20), ("buffered", 1 << 20), ("buffered", 700)]:
        ch = InprocChannel(window=1000)
        st = scatter(src, region, OutStream(ch.sender), mode=mode, max_chunk_bytes=limit)
        assert st.chunks == {"naive": len(pieces), "buffered": 1 if limit > 700 else 3}[mode]
        sink, tables = new_sink(layout)
        gather(InStream(ch.receiver), sink, num_chunks=st.chunks, timeout=1)
        got.append([seq_kv(sink.cache, tables[s.request_id], s.token_start, s.token_end, range(2, 5)) for s in seqs])
    want = [seq_kv(src, s.block_ids, s.token_start, s.token_end, range(2, 5)) for s in seqs]
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want))

"""Streaming a running engine's KV (naive / buffered / layer-by-layer + overlap), scatter pieces,
and pull mode: tokens unchanged, destination KV equal to the source's."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvflow.sched.sampling import SamplingParams
from kvflow.kv.cache import KVLayout
from kvflow.streaming.errors import PeerRejected, StreamingError
from kvflow.streaming.overlap import KVStreamer, StreamerConfig, attach
from kvflow.streaming.primitives import InStream, OutStream, fetch
from kvflow.streaming.pull import PullHandle, PullServer, pull
from kvflow.streaming.region import KVRegion, contiguous_pieces
from kvflow.streaming.scatter import gather, scatter
from kvflow.streaming.transports import InprocChannel, TcpReceiver, TcpSender
from kvhelpers import new_sink, random_cache, random_seqs, seq_kv, tiny_engine

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
    streamer = KVStreamer(engine.kv_cache, OutStream(TcpSender(rx.address, window=16)), StreamerConfig(mode=mode))
    attach(engine, streamer)
    stop, result = threading.Event(), {}
    t = threading.Thread(target=receive_all, args=(rx, engine.kv_cache.layout, stop, result))
    t.start()
    engine.scheduler.config = type(engine.scheduler.config)(max_num_batched_tokens=8, prefill_chunk_size=8)  # chunked prefill too
    tokens = generate(engine)
    streamer.finish()
    stop.set()
    t.join()
    streamer.close()
    streamer.out.sender.close()
    rx.close()
    assert tokens == reference
    sink, tables = result["sink"], result["tables"]
    for i, p in enumerate(PROMPTS):
        rid = f"q{i}"
        n = len(p) + PARAMS.max_tokens - 1  # the last sampled token is never fed back
        assert sink.received[rid].shape[2] == n and sink.received[rid].all()
        src = seq_kv(engine.kv_cache, streamer.tables[rid], 0, n, range(4))
        assert torch.equal(src, seq_kv(sink.cache, tables[rid], 0, n, range(4)))


def test_background_failure_stops_the_engine():
    engine = tiny_engine()
    ch = InprocChannel(window=1, timeout=0.5)  # nobody consumes: the sender times out
    streamer = KVStreamer(engine.kv_cache, OutStream(ch.sender), StreamerConfig(mode="overlap", pool_size=1, timeout=2))
    attach(engine, streamer)
    with pytest.raises(StreamingError, match="PeerTimeout|fell"):
        generate(engine)
    streamer.close()


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


def test_pull_mode_keeps_region_until_acknowledged():
    layout = KVLayout(32, 4, 2, 8, 0, 2)
    src = random_cache(layout, 5)
    seqs = random_seqs(random.Random(4), 32, 4, [10, 7])
    released = []
    server = PullServer(src, on_release=released.append, max_chunk_bytes=400)
    try:
        handle = PullHandle.from_bytes(server.publish(KVRegion(tuple(seqs), 0, 2)).to_bytes())
        assert server.pending == [handle.handle] and not released
        wrong, _ = new_sink(KVLayout(32, 4, 3, 8, 0, 2))  # wrong head count: rejected, nothing acked
        with pytest.raises(Exception, match="heads"):
            pull(handle, wrong, timeout=5)
        assert server.pending == [handle.handle] and not released
        sink, tables = new_sink(layout)
        st = pull(handle, sink, timeout=5)
        assert st.chunks == 2 and released == [handle.handle] and not server.pending
        for s in seqs:
            assert torch.equal(seq_kv(src, s.block_ids, s.token_start, s.token_end, range(2)), seq_kv(sink.cache, tables[s.request_id], s.token_start, s.token_end, range(2)))
        with pytest.raises(PeerRejected, match="unknown or released"):
            pull(handle, new_sink(layout)[0], timeout=5)
    finally:
        server.close()

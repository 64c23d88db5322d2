"""Streaming a running engine's KV through the KV connector (naive / buffered / layer-by-layer +
overlap) and its receiver, and scatter pieces: tokens unchanged, destination KV equal to the source's."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from kvflow.sched.sampling import SamplingParams
from kvflow.kv.cache import KVLayout
from kvflow.kv.cache import KVCache
from kvflow.streaming.chunk import ChunkDesc, Segment
from kvflow.streaming.connector import KVReceiver, KVSender
from kvflow.streaming.errors import StreamingError
from kvflow.streaming.primitives import InStream, OutStream, fetch
from kvflow.streaming.region import KVRegion, contiguous_pieces, token_slots
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


def _receiver_pair(layout: KVLayout, increments: bool):
    dst = KVCache(layout)
    rx = TcpReceiver()
    done, errors, arrived = [], [], threading.Event()

    def complete(rids, spans):
        done.extend(zip(rids, spans))
        arrived.set()

    def error(message):
        errors.append(message)
        arrived.set()

    receiver = KVReceiver(dst, InStream(rx), complete, error, increments=increments)
    receiver.start()
    return dst, rx, receiver, done, errors, arrived


def test_replication_increments_land_at_the_slots_they_name():
    # what a stage replicates after each step: tokens [start, end) of several requests, one chunk
    # naming the flat slots (the replica shares the block ids); reported at once, no table kept
    layout = KVLayout(40, 4, 2, 8, 2, 5)
    src = random_cache(layout, 7)
    seqs = random_seqs(random.Random(5), 40, 4, [13, 22, 3])
    dst, rx, receiver, done, errors, arrived = _receiver_pair(layout, increments=True)
    sender = KVSender(src, 0, {1: OutStream(TcpSender(rx.address))}, mode="overlap")
    try:
        for step in ((0, 1), (1, None)):  # [0, start) first, then [start, end): two increments per request
            segs, slots = [], []
            for s in seqs:
                a, b = (0, s.token_start) if step[1] is not None else (s.token_start, s.token_end)
                if a < b:
                    segs.append(Segment(s.request_id, a, b))
                    slots += token_slots(s.block_ids, a, b, layout.block_size)
            arrived.clear()
            sender.send_increment(segs, slots, epoch=0)
            sender.finish()
            assert arrived.wait(30) and not errors
        assert sorted(done) == sorted([(s.request_id, (0, s.token_start)) for s in seqs if s.token_start]
                                      + [(s.request_id, (s.token_start, s.token_end)) for s in seqs])
        for s in seqs:
            assert torch.equal(seq_kv(src, s.block_ids, 0, s.token_end, range(2, 5)), seq_kv(dst, s.block_ids, 0, s.token_end, range(2, 5)))
        assert receiver.tables == {} and receiver.sink.expected == {}  # nothing kept per request
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("case", ["not a replica", "slot outside the cache", "fewer slots than tokens"])
def test_a_bad_increment_is_rejected_and_writes_nothing(case):
    layout = KVLayout(40, 4, 2, 8, 2, 5)
    src = random_cache(layout, 8)
    dst, rx, receiver, done, errors, arrived = _receiver_pair(layout, increments=case != "not a replica")
    before = dst.data.clone()
    sender = KVSender(src, 0, {1: OutStream(TcpSender(rx.address))}, mode="overlap")
    slots = {"slot outside the cache": [5, 6, 40 * 4], "fewer slots than tokens": [5, 6]}.get(case, [5, 6, 7])
    try:
        if case == "fewer slots than tokens":  # the sender refuses it itself; forge it past that check
            with pytest.raises(ValueError, match="2 slots for 3 tokens"):
                sender.send_increment([Segment("r", 0, 3)], slots, epoch=0)
            sender._put(1, ChunkDesc((Segment("r", 0, 3),), 2, 5), torch.tensor([5, 6, 7]),
                        {"epoch": 0, "slots": np.asarray(slots, dtype="<i8").tobytes()})
        elif case == "slot outside the cache":  # packing reads the source at valid slots; the header names others
            sender._put(1, ChunkDesc((Segment("r", 0, 3),), 2, 5), torch.tensor([5, 6, 7]),
                        {"epoch": 0, "slots": np.asarray(slots, dtype="<i8").tobytes()})
        else:
            sender.send_increment([Segment("r", 0, 3)], slots, epoch=0)
        assert arrived.wait(30)
        with pytest.raises(StreamingError):  # the sender learns it from the acknowledgement
            sender.finish()
        assert done == [] and len(errors) == 1 and torch.equal(dst.data, before)
    finally:
        receiver.close()
        sender.close()

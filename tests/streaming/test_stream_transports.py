"""Byte-exact round trips through every transport, across real processes for TCP and shared
memory, through the file store after reopening it; a dead peer fails the sender quickly."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

from kvflow.kv.cache import KVLayout
from kvflow.streaming.chunk import ChunkDesc, Segment, decode_header, encode_header, make_header, payload_tensor, tensor_bytes
from kvflow.streaming.errors import ChunkCorrupted, ChunkTruncated, PeerError, PeerGone, PeerRejected
from kvflow.streaming.primitives import Chunk, InStream, OutStream, authenticate, fetch, fetch_many, flush, flush_many
from kvflow.streaming.transport import buffer_address
from kvflow.streaming.region import KVRegion
from kvflow.streaming.scatter import gather, scatter
from kvflow.streaming.transports import FileReceiver, FileSender, InprocChannel, ShmReceiver, ShmSender, TcpReceiver, TcpSender
from kvflow.streaming.transports.file import chunk_path
from kvhelpers import new_sink, random_cache, random_seqs, receiver_process, seq_kv

LAYOUT = KVLayout(num_blocks=64, block_size=4, num_kv_heads=2, head_dim=8, layer_start=0, layer_end=3)


def pairs(kind: str, tmp_path):
    if kind == "inproc":
        ch = InprocChannel(window=4)
        return ch.sender, ch.receiver
    if kind == "tcp":
        rx = TcpReceiver()
        return TcpSender(rx.address, window=4), rx
    if kind == "shm":
        rx = ShmReceiver()
        return ShmSender(rx.address, slots=2, slot_bytes=1 << 20), rx
    return FileSender(tmp_path / "store"), FileReceiver(tmp_path / "store")


def tensors(n: int):
    g = torch.Generator().manual_seed(n)
    sizes = [1, 3, 700, 5000]  # up to 5000 tokens x 2 x 2 x 8 floats = 640 KB: the zero-copy path
    for i in range(n):
        t = sizes[i % len(sizes)]
        yield ChunkDesc((Segment(f"r{i}", 0, t),), 0, 1), torch.randn(1, 2, t, 2, 8, generator=g)


@pytest.mark.parametrize("kind", ["inproc", "tcp", "shm", "file"])
def test_round_trip_is_byte_exact(kind, tmp_path):
    """Sender and receiver interleaved in one thread: more chunks than the window, so acks flow."""
    tx, rx = pairs(kind, tmp_path)
    out, inp = OutStream(tx), InStream(rx)
    for desc, x in tensors(10):
        flush(out, desc, x)
        with fetch(inp, 5) as c:
            assert c.header.desc == desc
            assert c.data.numpy().tobytes() == x.numpy().tobytes()
    out.drain()
    tx.close()
    rx.close()


def test_shm_reserve_packs_in_place(tmp_path):
    rx = ShmReceiver()
    tx = ShmSender(rx.address, slots=2, slot_bytes=1 << 16)
    src = random_cache(LAYOUT, 1)
    seqs = random_seqs(random.Random(0), LAYOUT.num_blocks, LAYOUT.block_size, [9, 14])
    st = scatter(src, KVRegion(tuple(seqs), 0, 3), OutStream(tx))
    sink, tables = new_sink(LAYOUT)
    gather(InStream(rx), sink, num_chunks=st.chunks, timeout=5)
    for s in seqs:
        assert torch.equal(seq_kv(src, s.block_ids, s.token_start, s.token_end, range(3)), seq_kv(sink.cache, tables[s.request_id], s.token_start, s.token_end, range(3)))
    tx.close()
    rx.close()


def _spawn_receiver(kind: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(kind, LAYOUT, child), daemon=True)
    proc.start()
    assert parent.poll(60), "receiver process did not start"
    return proc, parent, parent.recv()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_cross_process_round_trip(kind):
    proc, conn, address = _spawn_receiver(kind)
    tx = TcpSender(address, window=4) if kind == "tcp" else ShmSender(address, slots=2, slot_bytes=1 << 20)
    src = random_cache(LAYOUT, 2)
    seqs = random_seqs(random.Random(1), LAYOUT.num_blocks, LAYOUT.block_size, [17, 5, 30])
    out = OutStream(tx)
    sent = scatter(src, KVRegion(tuple(seqs[:2]), 0, 3), out, mode="naive").chunks
    sent += scatter(src, KVRegion(tuple(seqs[2:]), 0, 3), out, mode="buffered").chunks
    out.drain()
    conn.send(sent)
    assert conn.poll(60)
    got = conn.recv()
    proc.join(10)
    tx.close()
    for s in seqs:
        kv, mask = got[s.request_id]
        assert mask[:, :, s.token_start : s.token_end].all() and not mask[:, :, : s.token_start].any()
        assert torch.equal(torch.from_numpy(kv)[:, :, s.token_start :], seq_kv(src, s.block_ids, s.token_start, s.token_end, range(3)))


def test_file_store_survives_reopening(tmp_path):
    src = random_cache(LAYOUT, 3)
    seqs = random_seqs(random.Random(2), LAYOUT.num_blocks, LAYOUT.block_size, [11, 6])
    store = tmp_path / "kv"
    out = OutStream(FileSender(store, fsync=True))
    n = scatter(src, KVRegion(tuple(seqs[:1]), 0, 3), out, mode="naive").chunks
    out.sender.close()
    out2 = OutStream(FileSender(store), stream_id="second")  # reopened writer appends after the last file
    n += scatter(src, KVRegion(tuple(seqs[1:]), 0, 3), out2).chunks
    assert len(FileReceiver(store)) == n and chunk_path(store, n - 1).exists()
    sink, tables = new_sink(LAYOUT)
    gather(InStream(FileReceiver(store)), sink, num_chunks=n, timeout=1)
    for s in seqs:
        assert torch.equal(seq_kv(src, s.block_ids, s.token_start, s.token_end, range(3)), seq_kv(sink.cache, tables[s.request_id], s.token_start, s.token_end, range(3)))


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_dead_peer_fails_fast(kind):
    proc, conn, address = _spawn_receiver(kind)
    tx = TcpSender(address, window=2, timeout=5) if kind == "tcp" else ShmSender(address, slots=2, slot_bytes=1 << 20, timeout=5)
    out = OutStream(tx)
    desc, x = next(iter(tensors(1)))
    flush(out, desc, x)
    out.drain()  # the peer is alive and acknowledging
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    start = time.monotonic()
    with pytest.raises(PeerError, match="disconnected|acknowledged nothing|no receiver"):
        for _ in range(100):
            flush(out, desc, x)
        out.drain()
    assert time.monotonic() - start < 15
    tx.close()


def test_unreachable_peer_fails_within_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tx = TcpSender(f"tcp://127.0.0.1:{port}", timeout=1)
    desc, x = next(iter(tensors(1)))
    start = time.monotonic()
    with pytest.raises(PeerGone, match="no receiver"):
        flush(OutStream(tx), desc, x)
    assert time.monotonic() - start < 10
    tx.close()


# ---------------------------------------------------------------- speed paths keep integrity
@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("tokens", [3, 5000])  # a copied frame / a payload sent in place from transport memory
def test_corrupted_and_truncated_payloads_are_rejected_through_real_transports(kind, tokens, tmp_path):
    tx, rx = pairs(kind, tmp_path)
    out, inp = OutStream(tx, "s", b"k" * 32), InStream(rx, secret=b"k" * 32)
    desc = ChunkDesc((Segment("r", 0, tokens),), 0, 1)
    x = torch.randn(1, 2, tokens, 2, 8)
    flush(out, desc, x)
    with fetch(inp, 5) as c:
        assert torch.equal(c.data, x)
    head = authenticate(encode_header(make_header("s", 1, desc, x)), b"k" * 32)
    payload = bytearray(tensor_bytes(x))
    payload[len(payload) // 2] ^= 0x10
    for bad, error in ((memoryview(payload), ChunkCorrupted), (tensor_bytes(x)[:-4], ChunkTruncated)):
        tx.send(head, bad)
        with pytest.raises(error):
            fetch(inp, 5)
        with pytest.raises(PeerRejected, match=error.__name__):  # the rejection reaches the sender
            tx.drain()
    flush(out, desc, x)  # still in step afterwards
    with fetch(inp, 5) as c:
        assert c.header.seq == 1 and torch.equal(c.data, x)
    tx.close()
    rx.close()


def test_shm_payload_changed_in_the_segment_after_send_is_rejected():
    """The receiver checks the bytes it reads in place, so a stray write to a slot is caught."""
    rx = ShmReceiver()
    tx = ShmSender(rx.address, slots=2, slot_bytes=1 << 20)
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 100),), 0, 1)
    room = tx.reserve(100 * 2 * 2 * 8 * 4)
    x = room.view(torch.float32).view(1, 2, 100, 2, 8)
    x.copy_(torch.randn(1, 2, 100, 2, 8))
    flush(out, desc, x)
    x[0, 1, 50, 1, 3] += 1.0  # the sender's memory is the receiver's: scribble on it after sending
    with pytest.raises(ChunkCorrupted, match="checksum"):
        fetch(inp, 5)
    tx.close()
    rx.close()


@pytest.mark.parametrize("kind", ["tcp", "shm", "file"])
def test_received_payload_is_a_view_of_transport_memory(kind, tmp_path):
    """Zero-copy receive: the chunk's tensor points into the receive buffer / mapped segment / mapped
    file the transport received into; no intermediate bytes object."""
    tx, rx = pairs(kind, tmp_path)
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 5000),), 0, 1)
    x = torch.randn(1, 2, 5000, 2, 8)
    flush(out, desc, x)
    raw = rx.recv(5)
    c = Chunk(decode_header(raw.header), payload_tensor(decode_header(raw.header), raw.payload), raw)
    assert c.data.data_ptr() == buffer_address(raw.payload) and torch.equal(c.data, x)
    if kind == "tcp":
        buf = raw.payload.obj  # the buffer the socket was read into, not a copy of it
        assert isinstance(buf, np.ndarray) and buffer_address(buf) == c.data.data_ptr()
    if kind == "file":
        assert isinstance(raw.payload.obj, mmap.mmap)
    if kind == "shm":
        seg = next(iter(rx.segments.values()))
        base = buffer_address(memoryview(seg))
        assert base <= c.data.data_ptr() < base + len(seg)
    c.release()
    if kind == "tcp":
        assert rx.pool.free[buf.size][-1] is buf  # back in the receiver's pool, for the next chunk
    out.drain()
    tx.close()
    rx.close()


def test_reserved_buffer_is_sent_in_place():
    """Zero-copy send (shm): a payload packed into `reserve()`d memory is not copied again, the
    chunk lands at the reserved offset."""
    rx = ShmReceiver()
    tx = ShmSender(rx.address, slots=2, slot_bytes=1 << 20)
    out, inp = OutStream(tx), InStream(rx)
    nbytes = 5000 * 2 * 2 * 8 * 4
    room = tx.reserve(nbytes)
    assert room is not None and room.numel() == nbytes
    x = room.view(torch.float32).view(1, 2, 5000, 2, 8)
    x.copy_(torch.randn(1, 2, 5000, 2, 8))
    expect = x.clone()
    flush(out, ChunkDesc((Segment("r", 0, 5000),), 0, 1), x)
    (token, _), = tx.link.inflight.values()
    assert token[0] == room.data_ptr() - tx._base
    with fetch(inp, 5) as c:
        assert torch.equal(c.data, expect)
    out.drain()
    tx.close()
    rx.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_coalesced_acks_never_hold_up_a_drain(kind, tmp_path):
    """Many chunks in flight, a receiver thread that fetches them all and then stops reading:
    its held-back acknowledgements still go out, so the sender's drain returns."""
    tx, rx = pairs(kind, tmp_path)
    tx.link.window = 1000
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 3),), 0, 1)
    x = torch.randn(1, 2, 3, 2, 8)
    n = 300
    got = []
    t = threading.Thread(target=lambda: [got.append(fetch(inp, 10).release()) for _ in range(n)])
    t.start()
    for _ in range(n):
        flush(out, desc, x)
    t.join(30)
    assert len(got) == n
    start = time.monotonic()
    out.drain()
    assert not tx.link.inflight and time.monotonic() - start < 5
    tx.close()
    rx.close()


class _SendSpy:
    """A socket whose sendmsg records the address of every buffer it is given."""

    def __init__(self, sock, seen: list) -> None:
        self.sock, self.seen = sock, seen

    def sendmsg(self, parts, *args):
        self.seen.extend(buffer_address(p) for p in parts)
        return self.sock.sendmsg(parts, *args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.mark.parametrize("tokens", [3, 5000, 40000])
def test_tcp_sends_straight_from_the_callers_memory(tokens):
    """Zero-copy send (TCP): the payload handed to the kernel is the caller's tensor itself."""
    rx = TcpReceiver()
    tx = TcpSender(rx.address)
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, tokens),), 0, 1)
    x = torch.randn(1, 2, tokens, 2, 8)
    flush(out, ChunkDesc((Segment("r", 0, 1),), 0, 1), x[:, :, :1].contiguous())  # connects
    fetch(inp, 5).release()
    seen = []
    tx.sock = _SendSpy(tx.sock, seen)
    t = threading.Thread(target=lambda: fetch(inp, 10).release())  # a 5 MB chunk needs a reader to go out
    t.start()
    flush(out, desc, x)
    t.join(10)
    assert x.data_ptr() in seen
    out.drain()
    tx.close()
    rx.close()


def test_shm_ring_hands_out_disjoint_ranges_and_reuses_the_low_end():
    from kvflow.streaming.transports.shm_segment import ALIGN, Ring

    ring, live, rng = Ring(64 * ALIGN), [], random.Random(0)
    for _ in range(20000):
        if live and rng.random() < 0.5:
            ring.free(live.pop(0 if rng.random() < 0.7 else rng.randrange(len(live))))  # acks mostly in order
            continue
        r = ring.alloc(rng.randint(1, 20 * ALIGN))
        if r is None:
            assert live  # only a ring with something in flight can be full
            continue
        assert 0 <= r[0] < r[1] <= 64 * ALIGN and r[0] % ALIGN == 0
        assert all(r[1] <= o[0] or o[1] <= r[0] for o in live)
        live.append(r)
    for r in live:
        ring.free(r)
    a = ring.alloc(ALIGN)
    ring.free(a)
    assert ring.alloc(ALIGN)[0] == 0  # an idle ring starts over where memory is warm


@pytest.mark.parametrize("kind", ["tcp", "shm", "file"])
@pytest.mark.parametrize("tokens", [3, 5000, 40000])  # copied into the message / sent from a sender buffer / sent in place (5 MB)
def test_caller_may_overwrite_its_tensor_as_soon_as_flush_returns(kind, tokens, tmp_path):
    tx, rx = pairs(kind, tmp_path) if kind != "shm" else (None, ShmReceiver())
    if kind == "shm":
        tx = ShmSender(rx.address, slots=2, slot_bytes=8 << 20)
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, tokens),), 0, 1)
    x = torch.randn(1, 2, tokens, 2, 8)
    sent = x.clone()
    got = []
    t = threading.Thread(target=lambda: got.append(fetch(inp, 10)))
    t.start()
    flush(out, desc, x)
    x.fill_(7.0)  # the caller reuses its buffer at once
    t.join(20)
    assert torch.equal(got[0].data, sent)
    got[0].release()
    out.drain()
    tx.close()
    rx.close()


def test_shm_receiver_serves_several_senders_and_survives_one_dying():
    """Chunks from several senders interleave; a sender that disconnects while the consumer still
    holds its chunk is dropped, and releasing that chunk acknowledges nothing of a newcomer's."""
    rx = ShmReceiver()
    inp = InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 3),), 0, 1)
    x = torch.randn(1, 2, 3, 2, 8)
    a, b = ShmSender(rx.address, slots=2, slot_bytes=1 << 16), ShmSender(rx.address, slots=2, slot_bytes=1 << 16)
    oa, ob = OutStream(a, "a"), OutStream(b, "b")
    flush(oa, desc, x)
    held = fetch(inp, 5)
    a.close()  # gone with a chunk still held by the consumer
    with pytest.raises(TimeoutError):
        fetch(inp, 0.2)  # the receiver notices
    c = ShmSender(rx.address, slots=2, slot_bytes=1 << 16)
    oc = OutStream(c, "c")
    sent = {("c", 0): x + 2, ("b", 0): x + 1, ("c", 1): x + 4, ("b", 1): x + 3}
    flush(oc, desc, sent["c", 0])
    flush(ob, desc, sent["b", 0])
    seen = {}
    first = fetch(inp, 5)  # c is connected now
    held.release()  # must not acknowledge anything of c's
    flush(oc, desc, sent["c", 1])  # would overwrite c's first chunk had a's ack freed it
    flush(ob, desc, sent["b", 1])
    seen[first.header.stream, first.header.seq] = first.data.clone()  # still what was sent?
    first.release()
    for _ in range(3):
        with fetch(inp, 5) as ch:
            seen[ch.header.stream, ch.header.seq] = ch.data.clone()
    assert sorted(seen) == sorted(sent)
    for k, data in seen.items():
        assert torch.equal(data, sent[k])
    ob.drain()
    oc.drain()
    b.close()
    c.close()
    rx.close()


def test_tcp_receiver_drops_a_sender_that_dies_mid_chunk_and_serves_the_others():
    """A connection that closes halfway through a chunk is dropped with its partial message; a
    header claiming an absurd payload is not allocated (the chunk comes out empty, so rejected)."""
    from kvflow.streaming.transports.tcp import _MSG
    from kvflow.streaming.transports.tcp_receiver import MAX_PAYLOAD

    rx = TcpReceiver()
    host, port = rx.address[len("tcp://") :].rsplit(":", 1)
    inp = InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 3),), 0, 1)
    x = torch.randn(1, 2, 3, 2, 8)
    head = encode_header(make_header("s", 0, desc, x))
    with socket.create_connection((host, int(port))) as dying:
        dying.sendall(_MSG.pack(0, len(head), 1 << 20) + head + bytes(1000))  # then dies
    with pytest.raises(TimeoutError):
        fetch(inp, 0.3)
    with socket.create_connection((host, int(port))) as liar:
        liar.sendall(_MSG.pack(0, len(head), MAX_PAYLOAD + 1) + head)
        with pytest.raises(ChunkTruncated):
            fetch(inp, 5)
    out = OutStream(TcpSender(rx.address), "good")
    flush(out, desc, x)
    with fetch(inp, 5) as c:
        assert c.header.stream == "good" and torch.equal(c.data, x)
    out.drain()
    out.sender.close()
    rx.close()


def test_chunk_size_follows_the_last_level_cache():
    from kvflow.streaming.chunk import CHUNK_BYTES, preferred_chunk_bytes

    assert preferred_chunk_bytes(32 << 20) == 4 << 20  # the development VM's L3
    assert preferred_chunk_bytes(36 << 20) == 4 << 20  # a power of two within an eighth
    assert preferred_chunk_bytes(2 << 20) == 1 << 20 and preferred_chunk_bytes(1 << 30) == 16 << 20  # clamped
    assert preferred_chunk_bytes(0) == 4 << 20  # unknown
    assert 1 << 20 <= CHUNK_BYTES <= 16 << 20


def test_shm_wakes_a_sleeping_receiver_and_sends_nothing_to_a_busy_one():
    """The sleeping-consumer protocol: chunks published while the receiver is not blocked cross
    without a single socket message; a receiver blocked in recv (its flag set in the segment) is
    woken by the next chunk."""
    from kvflow.streaming.transports.shm_segment import RX_SLEEPING

    rx = ShmReceiver()
    tx = ShmSender(rx.address, slots=2, slot_bytes=1 << 16)
    out, inp = OutStream(tx), InStream(rx)
    desc = ChunkDesc((Segment("r", 0, 3),), 0, 1)
    x = torch.randn(1, 2, 3, 2, 8)
    flush(out, desc, x)
    fetch(inp, 5).release()  # attached
    (peer,) = rx.peers.values()
    for i in range(10):  # the receiver is not waiting: nothing but the segment is written
        flush(out, desc, x + i)
    with pytest.raises(BlockingIOError):
        peer.sock.recv(64, socket.MSG_DONTWAIT)
    for i in range(10):
        with fetch(inp, 5) as c:
            assert torch.equal(c.data, x + i)
    got = []
    t = threading.Thread(target=lambda: got.append(fetch(inp, 20).data.clone()))
    t.start()
    deadline = time.monotonic() + 20
    while not peer.ctl[RX_SLEEPING] and time.monotonic() < deadline:  # until it announced its sleep
        time.sleep(0.001)
    assert peer.ctl[RX_SLEEPING] == 1
    flush(out, desc, x + 100)
    t.join(30)
    assert len(got) == 1 and torch.equal(got[0], x + 100)
    tx.close()
    rx.close()


# ---------------------------------------------------------------- batches: flush_many / fetch_many
@pytest.mark.parametrize("kind", ["inproc", "tcp", "shm", "file"])
def test_batches_round_trip_byte_exact_and_in_order(kind, tmp_path):
    """flush_many hands many chunks to the transport at once (more than its window: the batch waits
    for acknowledgements midway); fetch_many returns them verified, in order."""
    tx, rx = pairs(kind, tmp_path)
    out, inp = OutStream(tx, "s", b"k" * 32), InStream(rx, secret=b"k" * 32)
    items = list(tensors(12))
    got, errors = [], []

    def receive():
        try:
            while len(got) < len(items):
                for c in fetch_many(inp, 5, timeout=5):
                    with c:
                        got.append((c.header.seq, c.header.desc, c.data.clone()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=receive)
    t.start()
    headers = flush_many(out, items, {"note": 1})
    out.drain()
    t.join(10)
    assert not errors and [h.seq for h in headers] == list(range(12)) and out.next_seq == 12
    assert [s for s, _, _ in got] == list(range(12))
    for (_, desc, data), (d, x) in zip(got, items):
        assert desc == d and torch.equal(data, x)
    tx.close()
    rx.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_fetch_many_returns_the_good_chunks_before_a_corrupted_one_then_raises(kind, tmp_path):
    tx, rx = pairs(kind, tmp_path)
    out, inp = OutStream(tx, "s"), InStream(rx)
    items = list(tensors(3))
    flush_many(out, items[:2])
    desc, x = items[2]
    payload = bytearray(tensor_bytes(x))
    payload[len(payload) // 2] ^= 0x01
    tx.send(encode_header(make_header("s", 2, desc, x)), memoryview(payload))
    deadline = time.monotonic() + 5
    while len(inp.pending) < 3 and time.monotonic() < deadline:  # all three in one batch
        inp.pending.extend(rx.recv_many(3 - len(inp.pending), 5))
    first = fetch_many(inp, 8, timeout=5)
    assert [c.header.seq for c in first] == [0, 1]  # verified ones first, none dropped
    for c in first:
        c.release()
    with pytest.raises(ChunkCorrupted, match="checksum"):
        fetch_many(inp, 8, timeout=5)
    with pytest.raises(PeerRejected, match="ChunkCorrupted"):
        tx.drain()
    tx.close()
    rx.close()


def test_tcp_message_read_while_acknowledging_the_previous_one_is_not_left_behind():
    # Acknowledging a chunk asks the connection whether more input is there, and that look reads the
    # start of the next message off the socket. The selector does not report those bytes again, so
    # a message that arrived just then waited for the next byte on that socket: for ever when it was
    # the sender's last (seen as a disaggregated request whose hand-off KV never completed).
    import select

    rx = TcpReceiver()
    tx = TcpSender(rx.address, timeout=10.0)
    try:
        tx.send(b"first", memoryview(b"x" * 100))
        first = rx.recv(timeout=10)
        assert first.header == b"first"
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0.05)  # nothing more now: the connection leaves the ready list
        tx.send(b"second", memoryview(b"y" * 100))
        conn = next(iter(rx.conns.values()))
        assert select.select([conn.sock], [], [], 10)[0], "the second message never reached the socket"
        first.release()  # the acknowledgement's look for more input reads the second message's bytes
        second = rx.recv(timeout=5)
        assert second.header == b"second" and bytes(second.payload) == b"y" * 100
        second.release()
        tx.drain()
    finally:
        tx.close()
        rx.close()

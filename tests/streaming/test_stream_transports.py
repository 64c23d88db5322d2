"""Byte-exact round trips through every transport, across real processes for TCP and shared
memory, through the file store after reopening it; a dead peer fails the sender quickly."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import time

import pytest
import torch

from kvflow.kv.cache import KVLayout
from kvflow.streaming.chunk import ChunkDesc, Segment
from kvflow.streaming.errors import PeerError, PeerGone
from kvflow.streaming.primitives import InStream, OutStream, fetch, flush
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

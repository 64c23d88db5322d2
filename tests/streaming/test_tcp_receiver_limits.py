"""A KV receiver's port costs a stranger's connections little (issue 39, D5): the header MAC is checked before
any payload buffer is taken, connections without an authentic header are capped and dropped after a short
timeout, and a peer holding the secret is served throughout. Waits are for events (a socket closed by the
receiver, a chunk arriving), the receiver being driven meanwhile."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvflow.streaming.chunk import ChunkDesc, Segment, encode_header, make_header
from kvflow.streaming.errors import ChunkError
from kvflow.streaming.primitives import InStream, OutStream, authenticate, fetch_many, flush
from kvflow.streaming.transports.tcp import _MSG, TcpSender
from kvflow.streaming.transports.tcp_receiver import PENDING_INBOX, TcpReceiver

SECRET = b"s" * 32


def _chunk(seq: int):
    desc = ChunkDesc((Segment("r", 0, 3),), 0, 1)
    return desc, torch.full((1, 2, 3, 2, 8), float(seq))


def _drive(inp: InStream, got: list) -> None:
    """Let the receiver run a moment: accept, read, verify, expire; keep what arrives, drop what is refused."""
    try:
        for c in fetch_many(inp, 64, timeout=0.02):
            got.append((c.header.stream, c.header.seq, c.data.clone()))
            c.release()
    except TimeoutError:
        pass
    except ChunkError:  # a stranger's chunk, refused (and the stranger told)
        pass


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_200_strangers_cost_no_payload_buffer_and_are_dropped(monkeypatch):
    rx = TcpReceiver(max_pending=8, auth_timeout=0.5)
    inp = InStream(rx, secret=SECRET)
    taken: list[int] = []
    take = rx.pool.take
    monkeypatch.setattr(rx.pool, "take", lambda n: taken.append(n) or take(n))
    host, port = rx.address[len("tcp://"):].rsplit(":", 1)
    got: list = []
    good = OutStream(TcpSender(rx.address, timeout=10.0), "good", SECRET)
    flush(good, *_chunk(0))  # a peer with the secret, connected before the flood
    deadline = time.monotonic() + 30
    while not got:
        assert time.monotonic() < deadline
        _drive(inp, got)
    assert len(taken) == 1  # its payload had a buffer

    desc, x = _chunk(9)
    forged = authenticate(encode_header(make_header("evil", 0, desc, x)), b"x" * 32)  # signed with another secret
    strangers = []
    try:
        for i in range(200):
            s = socket.create_connection((host, int(port)), timeout=5)
            if i % 4 == 1:  # a header announcing a 16 MiB payload, then some of it
                s.sendall(_MSG.pack(0, len(forged), 16 << 20) + forged + bytes(4096))
            elif i % 4 == 2:  # a 16 MiB header: more than a stranger may send before it authenticates
                s.sendall(_MSG.pack(0, 16 << 20, 0) + bytes(4096))
            elif i % 4 == 3:  # half a prefix, then nothing
                s.sendall(b"\x00" * 7)
            s.setblocking(False)
            strangers.append(s)
            if i % 8 == 7:
                _drive(inp, got)
                assert len(rx.pending) <= rx.max_pending
                assert all(len(c.inbox) <= 4 * PENDING_INBOX for c in rx.pending.values())
        flush(good, *_chunk(1))  # still served during the flood (it authenticated before it)
        while len(got) < 2 or not all(_closed_by_peer(s) for s in strangers):
            assert time.monotonic() < deadline, f"{len(rx.pending)} pending, {len(got)} chunks"
            _drive(inp, got)
            assert len(rx.pending) <= rx.max_pending
        assert len(taken) == 2 and max(taken) < 4096  # the good chunks' buffers; none for a stranger's payload
        assert rx.refused >= 150  # idle, half a prefix, forged: dropped for the cap or the timeout (16 MiB headers at once)
        assert not rx.pending and len(rx.conns) == 1  # only the good sender's connection is left
        # and a sender that connects after the flood authenticates and is served
        late = OutStream(TcpSender(rx.address, timeout=10.0), "late", SECRET)
        flush(late, *_chunk(0))
        while len(got) < 3:
            assert time.monotonic() < deadline
            _drive(inp, got)
        assert [(s, q) for s, q, _ in got] == [("good", 0), ("good", 1), ("late", 0)] and len(taken) == 3
        assert torch.equal(got[1][2], _chunk(1)[1])
        good.drain()
        late.drain()
    finally:
        for s in strangers:
            s.close()
        good.sender.close()
        rx.close()


def test_a_forged_header_is_rejected_to_its_sender_without_a_buffer(monkeypatch):
    rx = TcpReceiver()
    inp = InStream(rx, secret=SECRET)
    monkeypatch.setattr(rx.pool, "take", lambda n: pytest.fail("a buffer for an unauthenticated payload"))
    tx = TcpSender(rx.address, timeout=10.0)
    desc, x = _chunk(0)
    tx.send(authenticate(encode_header(make_header("evil", 0, desc, x)), b"x" * 32), memoryview(bytes(1 << 20)))
    with pytest.raises(ChunkError, match="not authentic"):
        fetch_many(inp, 8, timeout=10)
    assert rx.pending  # still pending: a wrong MAC authenticates nothing
    tx.close()
    rx.close()

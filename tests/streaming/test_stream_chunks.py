"""Chunk format and validation: every malformed chunk is rejected before reaching a cache."""

from __future__ import annotations

import pytest
import torch

from kvflow.kv.cache import KVLayout
from kvflow.streaming.chunk import ChunkDesc, Segment, decode_header, encode_header, make_header, tensor_bytes
from kvflow.streaming.errors import (
    ChunkCorrupted,
    ChunkMismatch,
    ChunkOutOfOrder,
    ChunkOversized,
    ChunkTruncated,
    DuplicateChunk,
    PeerRejected,
)
from kvflow.streaming.primitives import InStream, OutStream, fetch, flush
from kvflow.streaming.scatter import gather
from kvflow.streaming.transports import InprocChannel
from kvhelpers import new_sink

LAYOUT = KVLayout(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, layer_start=0, layer_end=2)
DESC = ChunkDesc((Segment("a", 0, 3), Segment("b", 5, 6)), 0, 2)


def data(seed: int = 0) -> torch.Tensor:
    return torch.randn(DESC.shape(2, 8), generator=torch.Generator().manual_seed(seed))


def channel():
    ch = InprocChannel(window=100, timeout=2)
    return ch, OutStream(ch.sender, "s"), InStream(ch.receiver, max_chunk_bytes=1 << 20)


def test_header_roundtrip_and_payload_is_byte_exact():
    x = data()
    h = make_header("s", 7, DESC, x, {"note": 1})
    assert decode_header(encode_header(h)) == h
    ch, out, inp = channel()
    flush(out, DESC, x)
    with fetch(inp, 1) as c:
        assert c.header.desc == DESC and torch.equal(c.data, x)


def test_header_bodies_are_validated_once_yet_every_header_is_its_own():
    """The receiver reuses a decoded body (all but seq and checksum) for the next chunk of a
    transfer; each header still gets its own seq, checksum and meta."""
    meta = {"kv": {"a": {"blocks": [1, 2]}}}
    d1 = decode_header(encode_header(make_header("s", 1, DESC, data(0), meta)))
    d1.meta["kv"]["a"]["blocks"].append(3)
    d2 = decode_header(encode_header(make_header("s", 2, DESC, data(1), meta)))
    assert d2.desc is d1.desc and d2.meta == {"kv": {"a": {"blocks": [1, 2]}}}
    assert (d2.seq, d2.checksum) == (2, make_header("s", 2, DESC, data(1)).checksum) != (d1.seq, d1.checksum)
    head = bytearray(encode_header(make_header("s", 3, DESC, data(0))))
    head[40] ^= 0x01  # the shape's layer count: no longer the described layers
    with pytest.raises(ChunkCorrupted):
        decode_header(bytes(head))


def send_raw(ch, header: bytes, payload: bytes) -> None:
    ch.sender.send(header, memoryview(payload))


def good(seq: int = 0, seed: int = 0) -> tuple[bytes, bytes]:
    x = data(seed)
    return encode_header(make_header("s", seq, DESC, x)), bytes(tensor_bytes(x))


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda h, p: (h, p[:-1]), ChunkTruncated),
        (lambda h, p: (h, p + b"\0"), ChunkOversized),
        (lambda h, p: (h, p[:10] + bytes([p[10] ^ 1]) + p[11:]), ChunkCorrupted),
        (lambda h, p: (h[:-3], p), ChunkCorrupted),
        (lambda h, p: (b"\x93garbage", p), ChunkCorrupted),
    ],
    ids=["truncated", "oversized", "bitflip", "cut-header", "garbage-header"],
)
def test_bad_chunks_are_rejected_and_sender_is_told(mutate, error):
    ch, out, inp = channel()
    send_raw(ch, *mutate(*good()))
    with pytest.raises(error):
        fetch(inp, 1)
    with pytest.raises(PeerRejected, match=error.__name__):
        ch.sender.send(*good())


def test_chunk_over_receiver_limit_is_rejected():
    ch = InprocChannel()
    flush(OutStream(ch.sender), DESC, data())
    with pytest.raises(ChunkOversized, match="at most 100"):
        fetch(InStream(ch.receiver, max_chunk_bytes=100), 1)


def test_out_of_order_and_duplicate_sequence_numbers():
    ch, out, inp = channel()
    send_raw(ch, *good(seq=1))
    with pytest.raises(ChunkOutOfOrder):
        fetch(inp, 1)
    with pytest.raises(PeerRejected, match="ChunkOutOfOrder"):
        send_raw(ch, *good(seq=0))
    send_raw(ch, *good(seq=0))
    fetch(inp, 1).release()
    send_raw(ch, *good(seq=0))
    with pytest.raises(DuplicateChunk):
        fetch(inp, 1)


def test_rejected_chunk_is_never_written_into_the_cache():
    ch, out, inp = channel()
    sink, _ = new_sink(LAYOUT)
    before = sink.cache.data.clone()
    h, p = good()
    send_raw(ch, h, p[:-4] + b"\xff\xff\xff\xff")
    with pytest.raises(ChunkCorrupted):
        gather(inp, sink, num_chunks=1, timeout=1)
    assert torch.equal(sink.cache.data, before) and not sink.received


@pytest.mark.parametrize(
    "desc, x, error, match",
    [
        (DESC, data(2), DuplicateChunk, "already received"),
        (ChunkDesc((Segment("zzz", 0, 1),), 0, 1), torch.zeros(1, 2, 1, 2, 8), ChunkMismatch, "not expected"),
        (ChunkDesc((Segment("a", 0, 1),), 0, 1), torch.zeros(1, 2, 1, 3, 8), ChunkMismatch, "heads"),
        (ChunkDesc((Segment("a", 0, 1),), 1, 3), torch.zeros(2, 2, 1, 2, 8), ChunkMismatch, "layers"),
    ],
    ids=["duplicate-region", "unexpected-request", "wrong-heads", "layers-not-held"],
)
def test_sink_rejects_duplicates_unexpected_regions_and_wrong_geometry(desc, x, error, match):
    ch, out, inp = channel()
    sink, _ = new_sink(LAYOUT)
    sink.expect("a", 0, 2, 0, 3)
    sink.expect("b", 0, 2, 5, 6)
    flush(out, DESC, data(1))
    gather(inp, sink, timeout=1)
    assert sink.complete
    snapshot = sink.cache.data.clone()
    flush(out, desc, x)
    with pytest.raises(error, match=match):
        gather(inp, sink, num_chunks=1, timeout=1)
    assert torch.equal(sink.cache.data, snapshot)
    with pytest.raises(PeerRejected, match=error.__name__):
        flush(out, DESC, data(3))


def test_flush_rejects_tensor_not_matching_description():
    ch, out, inp = channel()
    with pytest.raises(ValueError, match="does not match"):
        flush(out, DESC, torch.zeros(2, 2, 3, 2, 8))


@pytest.mark.parametrize("tokens", [1, 700, 5000])
def test_every_flipped_bit_and_every_cut_is_caught(tokens):
    """The checksum covers every payload byte at every size (also the sizes sent in place)."""
    import random

    rng = random.Random(tokens)
    desc = ChunkDesc((Segment("a", 0, tokens),), 0, 1)
    x = torch.randn(1, 2, tokens, 2, 8, generator=torch.Generator().manual_seed(tokens))
    head, payload = encode_header(make_header("s", 0, desc, x)), bytes(tensor_bytes(x))
    for _ in range(20):
        i, bit = rng.randrange(len(payload)), 1 << rng.randrange(8)
        ch, out, inp = channel()
        send_raw(ch, head, payload[:i] + bytes([payload[i] ^ bit]) + payload[i + 1 :])
        with pytest.raises(ChunkCorrupted, match="checksum"):
            fetch(inp, 1)
        ch, out, inp = channel()
        send_raw(ch, head, payload[: rng.randrange(len(payload))])
        with pytest.raises(ChunkTruncated):
            fetch(inp, 1)

"""Level 1 of DéjàVuLib: `flush` one contiguous KV tensor to a stream, `fetch` the next verified one."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.streaming.chunk import ChunkDesc, ChunkHeader, decode_header, encode_header, make_header, payload_tensor, tensor_bytes, verify_payload
from kvflow.streaming.errors import ChunkCorrupted, ChunkError, ChunkOutOfOrder, DuplicateChunk
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk

DEFAULT_MAX_CHUNK_BYTES = 1 << 30
_RELEASED = torch.empty(0)


class OutStream:
    """A numbered sequence of chunks to one destination. The stream id is unique per instance."""

    def __init__(self, sender: ChunkSender, stream_id: str | None = None, secret: bytes | None = None) -> None:
        self.sender = sender
        self.stream_id = stream_id or uuid.uuid4().hex[:12]
        self.secret = secret  # when set, every header carries a keyed MAC (see `authenticate`)
        self.next_seq = 0
        self.bytes_sent = 0
        self.chunks_sent = 0

    def drain(self) -> None:
        self.sender.drain()


@dataclass
class Chunk:
    """A verified chunk: `data` is a read-only view into transport memory, valid until `release()`."""

    header: ChunkHeader
    data: torch.Tensor
    raw: RawChunk

    def release(self, error: str | None = None) -> None:
        self.data = _RELEASED  # drop the view first so transport memory (shm slot, mmap) can be unmapped
        self.raw.release(error)

    def __enter__(self) -> "Chunk":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(None if exc is None else f"{type(exc).__name__}: {exc}")


class InStream:
    """Receives chunks from any number of OutStreams through one receiver, checking each stream's
    sequence numbers (no gaps, no repeats), sizes and checksums."""

    def __init__(self, receiver: ChunkReceiver, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, secret: bytes | None = None) -> None:
        if max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self.receiver = receiver
        self.secret = secret  # when set, a chunk whose header MAC does not verify is rejected
        if secret is not None:  # (by the transport itself where it can, before it buffers the payload)
            receiver.check_headers(lambda head: is_authentic(head, secret))
        self.max_chunk_bytes = max_chunk_bytes
        self.expected_seq: dict[str, int] = {}
        self.pending: deque[RawChunk] = deque()  # received by `fetch_many`, not yet verified and handed out

    def check_order(self, h: ChunkHeader) -> None:
        want = self.expected_seq.get(h.stream, 0)
        if h.seq < want:
            raise DuplicateChunk(f"chunk {h.stream}#{h.seq} was already received (next expected #{want})")
        if h.seq > want:
            raise ChunkOutOfOrder(f"chunk {h.stream}#{h.seq} arrived before #{want}")


MAC_BYTES = 16


def _mac(secret: bytes, head: bytes) -> bytes:
    return hashlib.blake2b(head, key=secret, digest_size=MAC_BYTES).digest()


def authenticate(head: bytes, secret: bytes) -> bytes:
    """The header frame with a keyed BLAKE2b MAC appended. The header holds the payload's checksum,
    so a stranger without the secret can neither forge a chunk nor relabel one."""
    return bytes(head) + _mac(secret, bytes(head))


def is_authentic(frame, secret: bytes) -> bool:
    """Whether a header frame ends in the MAC of the rest under `secret`."""
    head = bytes(frame)
    return len(head) > MAC_BYTES and hmac.compare_digest(head[-MAC_BYTES:], _mac(secret, head[:-MAC_BYTES]))


def verified_header(frame, secret: bytes) -> bytes:
    head = bytes(frame)
    if not is_authentic(head, secret):
        raise ChunkCorrupted("chunk header is not authentic (no or wrong MAC)")
    return head[:-MAC_BYTES]


def flush(out: OutStream, desc: ChunkDesc, data: torch.Tensor, meta: dict[str, Any] | None = None) -> ChunkHeader:
    """Send one contiguous host tensor shaped like `desc` as the stream's next chunk.

    Contract: `data` must be contiguous, on the CPU, with shape [layers, kinds, tokens, kv_heads,
    head_dim] matching `desc`; it may be reused when flush returns. Returns the header sent. Raises
    ValueError for a tensor that does not match `desc`, and the transport's PeerError when the
    destination is gone, unresponsive or rejected an earlier chunk.
    """
    header, head, payload = _frame(out, out.next_seq, desc, data, meta)
    out.sender.send(head, payload)
    out.next_seq += 1
    out.chunks_sent += 1
    out.bytes_sent += header.nbytes
    return header


def flush_many(out: OutStream, items: Iterable[tuple[ChunkDesc, torch.Tensor]], meta: dict[str, Any] | None = None) -> list[ChunkHeader]:
    """`flush` of each (desc, tensor) in order, handed to the transport together (`send_many`: one
    system call, one publication for many chunks), so small chunks share the per-chunk costs.
    Same contract as `flush`, except that after a PeerError the stream is to be abandoned (which
    of the chunks went out is not known)."""
    headers, frames = [], []
    for desc, data in items:
        header, head, payload = _frame(out, out.next_seq + len(headers), desc, data, meta)
        headers.append(header)
        frames.append((head, payload))
    if frames:
        out.sender.send_many(frames)
    out.next_seq += len(headers)
    out.chunks_sent += len(headers)
    out.bytes_sent += sum(h.nbytes for h in headers)
    return headers


def _frame(out: OutStream, seq: int, desc: ChunkDesc, data: torch.Tensor, meta: dict[str, Any] | None) -> tuple[ChunkHeader, bytes, memoryview]:
    """(header, its bytes as sent, payload view) of chunk `seq` of `out`."""
    if data.dim() != 5 or tuple(data.shape[:3]) != (desc.num_layers, len(desc.kinds), desc.num_tokens):
        raise ValueError(f"tensor of shape {tuple(data.shape)} does not match {desc}")
    payload = tensor_bytes(data)
    header = make_header(out.stream_id, seq, desc, data, meta, payload)
    head = encode_header(header)
    return header, authenticate(head, out.secret) if out.secret else head, payload


def fetch(inp: InStream, timeout: float | None = None) -> Chunk:
    """Receive, verify and return the next chunk.

    Contract: the returned chunk's bytes match its checksum, its size is within the receiver's limit
    and its sequence number is exactly the next one of its stream. Otherwise the chunk is released
    back to the sender as rejected and a ChunkError subclass is raised (ChunkCorrupted,
    ChunkTruncated, ChunkOversized, ChunkOutOfOrder, DuplicateChunk). TimeoutError if nothing arrives.
    The caller copies `data` out and releases the chunk (or uses it as a context manager).
    """
    raw = inp.pending.popleft() if inp.pending else inp.receiver.recv(timeout)
    chunk = verify(raw, inp.max_chunk_bytes, inp.secret, inp.check_order)
    inp.expected_seq[chunk.header.stream] = chunk.header.seq + 1
    return chunk


def fetch_many(inp: InStream, max_chunks: int = 64, timeout: float | None = None) -> list[Chunk]:
    """`fetch` of the next chunk (waiting up to `timeout`) and of those already there after it, at
    most `max_chunks` in all, in order. Each is verified as `fetch` verifies it; a chunk that fails
    is released as rejected and its ChunkError raised, by this call when it is the first, else by
    the next call (the chunks verified before it are returned first; none is dropped)."""
    if not inp.pending:
        inp.pending.extend(inp.receiver.recv_many(max_chunks, timeout))
    chunks: list[Chunk] = []
    while inp.pending and len(chunks) < max_chunks:
        try:
            chunk = verify(inp.pending[0], inp.max_chunk_bytes, inp.secret, inp.check_order, release_on_error=not chunks)
        except ChunkError:
            if chunks:
                break  # left pending: the next call rejects it and raises
            inp.pending.popleft()
            raise
        inp.pending.popleft()
        inp.expected_seq[chunk.header.stream] = chunk.header.seq + 1
        chunks.append(chunk)
    return chunks


def verify(raw: RawChunk, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, secret: bytes | None = None,
           check=None, release_on_error: bool = True) -> Chunk:
    """A raw chunk as a verified `Chunk` (header MAC when `secret`, header, size, checksum, then
    `check(header)`), or the raw chunk released as rejected (unless `release_on_error` is False)
    and the ChunkError raised. `fetch` is this plus the stream's order; the KV tiers' disk store
    reads its slots with it."""
    try:
        head = verified_header(raw.header, secret) if secret else raw.header
        header = decode_header(head)
        verify_payload(header, raw.payload, max_chunk_bytes)
        if check is not None:
            check(header)
    except ChunkError as e:
        if release_on_error:
            raw.release(f"{type(e).__name__}: {e}")
        raise
    return Chunk(header, payload_tensor(header, raw.payload), raw)

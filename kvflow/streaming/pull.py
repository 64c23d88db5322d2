"""Pull mode (KVDirect): the source publishes a described region and keeps it until the receiver,
when it is ready, pulls it and acknowledges; push mode is the scatter/stream_out path."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from kvflow.kv.cache import KVCache
from kvflow.streaming.chunk import DTYPE_NAMES, ChunkDesc, Segment, encode_header, make_header, tensor_bytes
from kvflow.streaming.errors import PeerRejected, PeerTimeout
from kvflow.streaming.primitives import InStream
from kvflow.streaming.region import KVRegion
from kvflow.streaming.scatter import KVSink, TransferStats, gather, split_layers
from kvflow.streaming.staging import Staging
from kvflow.streaming.transport import ChunkReceiver, RawChunk


@dataclass(frozen=True)
class PullHandle:
    """A published region, described by geometry (no source block ids): enough to allocate
    destination blocks before pulling. Small enough to forward through any control channel."""

    address: str
    handle: str
    desc: ChunkDesc
    dtype: str
    kv_heads: int
    head_dim: int

    def to_bytes(self) -> bytes:
        d = self.desc
        segs = [[s.request_id, s.token_start, s.token_end] for s in d.segments]
        return msgpack.packb([self.address, self.handle, segs, d.layer_start, d.layer_end, self.dtype, self.kv_heads, self.head_dim])

    @classmethod
    def from_bytes(cls, raw: bytes) -> "PullHandle":
        addr, handle, segs, l0, l1, dtype, kvh, hd = msgpack.unpackb(raw)
        return cls(addr, handle, ChunkDesc(tuple(Segment(*s) for s in segs), l0, l1), dtype, kvh, hd)


class PullServer:
    """Serves published regions of `cache` from a background thread on a free port.

    Contract: `publish(region)` returns a PullHandle; the region's blocks must stay untouched
    until `on_release(handle_id)` is called, which happens only when a puller acknowledged a
    complete, verified copy. A pull of an unknown or released handle is answered with an error.
    """

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", on_release: Callable[[str], None] | None = None, max_chunk_bytes: int = 64 << 20) -> None:
        self.cache = cache
        self.on_release = on_release
        self.max_chunk_bytes = max_chunk_bytes
        self.published: dict[str, KVRegion] = {}
        self._lock = threading.Lock()
        self.ctx = zmq.Context.instance()  # shared and never terminated: no term() hang at GC
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-pull-server", daemon=True)
        self._thread.start()

    def publish(self, region: KVRegion) -> PullHandle:
        hid = uuid.uuid4().hex[:16]
        with self._lock:
            self.published[hid] = region
        lay = self.cache.layout
        return PullHandle(self.address, hid, region.desc, DTYPE_NAMES[lay.dtype], lay.num_kv_heads, lay.head_dim)

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return list(self.published)

    def _serve(self) -> None:
        staging = Staging(self.cache.device)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, raw = self.sock.recv_multipart()
            op, hid = msgpack.unpackb(raw)
            with self._lock:
                region = self.published.get(hid)
            if region is None:
                self.sock.send_multipart([ident, b"error", f"unknown or released handle {hid!r}".encode()])
            elif op == "pull":
                self._send_region(ident, hid, region, staging)
            elif op == "ack":
                with self._lock:
                    self.published.pop(hid, None)
                if self.on_release is not None:
                    self.on_release(hid)
                self.sock.send_multipart([ident, b"acked", b""])
            else:
                self.sock.send_multipart([ident, b"error", f"unknown operation {op!r}".encode()])

    def _send_region(self, ident: bytes, hid: str, region: KVRegion, staging: Staging) -> None:
        lay = self.cache.layout
        slots = region.slot_tensor(lay.block_size)
        per_layer = 2 * region.num_tokens * lay.num_kv_heads * lay.head_dim * lay.dtype_bytes
        parts = split_layers(region, per_layer, self.max_chunk_bytes)
        self.sock.send_multipart([ident, b"count", msgpack.packb(len(parts))])
        for seq, part in enumerate(parts):
            data, event = staging.pack(self.cache, part, slots)
            if event is not None:
                event.synchronize()
            header = make_header(hid, seq, part.desc, data)
            self.sock.send_multipart([ident, b"chunk", encode_header(header), tensor_bytes(data)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)


class _PullReceiver(ChunkReceiver):
    """Adapts the reply stream of one pull to the ChunkReceiver interface, so `fetch` verifies it."""

    def __init__(self, sock: zmq.Socket, address: str, timeout: float) -> None:
        self.sock, self.address, self.timeout = sock, address, timeout

    def next(self) -> tuple[bytes, list[zmq.Frame]]:
        if not self.sock.poll(self.timeout * 1000):
            raise PeerTimeout(f"pull server at {self.address} did not answer within {self.timeout}s")
        kind, *rest = self.sock.recv_multipart(copy=False)
        if kind.bytes == b"error":
            raise PeerRejected(f"pull server at {self.address}: {rest[0].bytes.decode()}")
        return kind.bytes, rest

    def recv(self, timeout: float | None = None) -> RawChunk:
        kind, rest = self.next()
        if kind != b"chunk" or len(rest) != 2:
            return RawChunk(b"", memoryview(b""))  # fails verification as a corrupted chunk
        return RawChunk(rest[0].bytes, rest[1].buffer)

    def close(self) -> None:
        pass


def pull(handle: PullHandle, sink: KVSink, timeout: float = 10.0) -> TransferStats:
    """Fetch a published region into `sink`, then acknowledge it so the source may free it.

    Contract: every chunk is verified (checksum, size, order) and fitted to the sink before it is
    written; on any failure nothing is acknowledged, the source keeps the region (a later pull may
    retry) and the error is raised. PeerTimeout when the source does not answer within `timeout`.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(handle.address)
    try:
        rx = _PullReceiver(sock, handle.address, timeout)
        sock.send(msgpack.packb(["pull", handle.handle]))
        kind, rest = rx.next()
        if kind != b"count":
            raise PeerRejected(f"pull server at {handle.address} answered {kind!r} to a pull")
        stats = gather(InStream(rx), sink, num_chunks=msgpack.unpackb(rest[0].bytes), timeout=timeout)
        sock.send(msgpack.packb(["ack", handle.handle]))
        kind, _ = rx.next()
        if kind != b"acked":
            raise PeerRejected(f"pull server at {handle.address} answered {kind!r} to an ack")
        return stats
    finally:
        sock.close(0)

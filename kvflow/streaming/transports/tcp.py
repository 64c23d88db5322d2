"""TCP transport over ZeroMQ: header and payload travel as two frames, acknowledged by the receiver.

Small payloads (< 96 KB) are copied into the ZeroMQ message. Medium ones are sent in place
from one of the sender's own buffers (one per such chunk in flight, plus one; each reused once the
receiver acknowledged what it held): `reserve` hands one out so a caller packs straight into it,
and any other payload is copied into one first, so `send` never waits for the wire (nor for
ZeroMQ to let go of a buffer) and the caller may reuse its tensor at once. Large ones (>= 4 MB)
are sent straight from the caller's memory, and `send` returns once ZeroMQ has handed it all to
the kernel: at that size the wait costs less than a copy, and no large buffers are kept.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk, buffer_address
from kvflow.streaming.transports.zmq_link import LinkReceiver, LinkSender

ZERO_COPY_BYTES = 96 << 10  # below this a copy into ZeroMQ's message is cheaper than tracking a buffer (measured: 64 KB copied, 126 KB in place)
IN_PLACE_BYTES = 4 << 20  # from this size on, send straight from the caller's memory and wait until ZeroMQ let go of it


class TcpSender(ChunkSender):
    """Connects to a `TcpReceiver`'s address ("tcp://host:port"). At most `window` chunks and
    `window_bytes` of payload (but always two chunks) may be unacknowledged."""

    def __init__(self, address: str, window: int = 64, timeout: float = 10.0, window_bytes: int = 32 << 20) -> None:
        self.link = LinkSender(address, window, timeout, on_ack=self._returned, window_bytes=window_bytes)
        self.timeout = timeout
        self._free: list[torch.Tensor] = []  # send buffers ZeroMQ no longer reads
        self._reserved: torch.Tensor | None = None

    def _returned(self, buf: torch.Tensor | None) -> None:
        if buf is not None:
            self._free.append(buf)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A send buffer of at least nbytes that is not in flight (waits for an ack when all are)."""
        while not self._free and self.link.inflight and self.link._full(nbytes):
            self.link._wait_one_ack()  # one comes back before the window lets this chunk go anyway
        if not self._free:
            return torch.empty(nbytes, dtype=torch.uint8)
        buf = self._free.pop()  # the most recently acknowledged: likeliest still in cache
        return buf if buf.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        if not ZERO_COPY_BYTES <= nbytes < IN_PLACE_BYTES:
            return None
        if self._reserved is None or self._reserved.numel() < nbytes:
            if self._reserved is not None:
                self._free.append(self._reserved)
            self._reserved = self._buffer(nbytes)
        return self._reserved[:nbytes]

    def send(self, header: bytes, payload: memoryview) -> None:
        n = payload.nbytes
        buf, self._reserved = self._reserved, None
        if n < ZERO_COPY_BYTES or n >= IN_PLACE_BYTES:
            if buf is not None:
                self._free.append(buf)
            if n < ZERO_COPY_BYTES:
                self.link.send(header, payload)
            else:
                self.link.send_in_place(header, payload)
            return
        if buf is None or buffer_address(payload) != buf.data_ptr():
            if buf is not None:
                self._free.append(buf)
            buf = self._buffer(n)
            buf[:n].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        try:
            self.link.send(header, buf[:n].numpy(), token=buf, copy=False)
        except BaseException:
            self._free.append(buf)
            raise

    def drain(self) -> None:
        self.link.drain()

    def close(self) -> None:
        self.link.close()
        self._free.clear()


class TcpReceiver(ChunkReceiver):
    """Binds host on a free port; `address` is what senders connect to. A payload is a view of the
    received ZeroMQ frame (no copy), valid until the chunk is released."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.link = LinkReceiver(host, port)

    @property
    def address(self) -> str:
        return self.link.address

    def recv(self, timeout: float | None = None) -> RawChunk:
        ident, tag, head, frames = self.link.recv(timeout)
        if len(frames) != 1:
            self.link.ack(ident, tag, f"expected a header and one payload frame, got {len(frames)} payload frames")
            return RawChunk(b"", memoryview(b""))
        link = self.link
        return RawChunk(bytes(head), frames[0].buffer, lambda err: link.ack(ident, tag, err))

    def close(self) -> None:
        self.link.close()

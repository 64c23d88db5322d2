"""TCP transport over ZeroMQ: header and payload travel as two raw frames, acknowledged by the receiver."""

from __future__ import annotations

from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk
from kvflow.streaming.transports.zmq_link import LinkReceiver, LinkSender


class TcpSender(ChunkSender):
    """Connects to a `TcpReceiver`'s address ("tcp://host:port"); `window` chunks may be unacknowledged."""

    def __init__(self, address: str, window: int = 8, timeout: float = 10.0) -> None:
        self.link = LinkSender(address, window, timeout)
        self.timeout = timeout

    def send(self, header: bytes, payload: memoryview) -> None:
        self.link.send([header, payload])

    def drain(self) -> None:
        self.link.drain()

    def close(self) -> None:
        self.link.close()


class TcpReceiver(ChunkReceiver):
    """Binds host on a free port; `address` is what senders connect to."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.link = LinkReceiver(host, port)

    @property
    def address(self) -> str:
        return self.link.address

    def recv(self, timeout: float | None = None) -> RawChunk:
        ident, tag, frames = self.link.recv(timeout)
        if len(frames) != 2:
            self.link.ack(ident, tag, f"expected 2 frames (header, payload), got {len(frames)}")
            return RawChunk(b"", memoryview(b""))
        return RawChunk(frames[0].bytes, frames[1].buffer, lambda err: self.link.ack(ident, tag, err))

    def close(self) -> None:
        self.link.close()

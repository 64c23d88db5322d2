"""TCP transport on plain sockets, written and read by the calling threads themselves, and its
sending side.

A chunk crosses as one message: a prefix (tag, header length, payload length), the header, the
payload. The sender hands header and payload to one `sendmsg` straight from the caller's memory:
when `send` returns the kernel holds a copy, so the caller may reuse its tensor at once, with no
copy in user space and no I/O thread. The receiver reads each payload straight into a buffer of its
own pool (reused once the chunk is released: warm memory, no page faults) and hands out a view of
it. Acknowledgements flow back on the same connection (`link`: coalesced, one small record per
chunk). A peer that exits or is killed closes its end, so the other side sees it at once; keepalive
probes notice a peer whose host vanished within a few seconds of silence.

Measured against ZeroMQ (benchmarks/transports.py): a ZeroMQ socket moves a message through two
I/O threads (the sender's and the receiver's) besides the callers, and allocates every received
message afresh; here two threads (the callers) do all the work.

`TcpSender` and the framing both sides share are here; `TcpReceiver`, with its buffer pool and its
admission of connections (the limits on peers without an authentic header), in `tcp_receiver`.
"""

from __future__ import annotations

import select
import socket
import struct
import time

from kvflow.streaming.errors import PeerGone, PeerTimeout
from kvflow.streaming.transport import ChunkSender
from kvflow.streaming.transports.link import Window

_MSG = struct.Struct("<QIQ")  # tag, header length, payload length; then the header, then the payload
_ACK = struct.Struct("<QI")  # tag, error length (0: accepted); then the error, UTF-8
MAX_HEAD = 16 << 20  # a longer header means a broken stream: the connection is dropped
IOV_BATCH = 256  # messages per sendmsg at most (two buffers each; the kernel takes up to IOV_MAX = 1024)


def _split(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise ValueError(f"not a TCP address: {address!r} (expected tcp://HOST:PORT)")
    host, port = address[6:].rsplit(":", 1)
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and acks go out at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.setblocking(False)  # every wait is a poll with the timeout


class TcpSender(ChunkSender):
    """Connects to a `TcpReceiver`'s address ("tcp://host:port") on the first send (PeerGone when
    nobody accepts within `timeout`). At most `window` chunks and `window_bytes` of payload (but
    always two chunks) may be unacknowledged."""

    def __init__(self, address: str, window: int = 64, timeout: float = 10.0, window_bytes: int = 32 << 20) -> None:
        self.link = Window(address, window, timeout, window_bytes=window_bytes)
        self.address = address
        self._host, self._port = _split(address)
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._acks = bytearray()  # acknowledgement bytes received, not yet a whole record
        self._broken: str | None = None  # a send stopped halfway: the stream is out of step for good

    # -------------------------------------------------------------- connection
    def _connect(self) -> socket.socket:
        if self._broken:
            raise PeerGone(self._broken)
        if self.sock is not None:
            return self.sock
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                s = socket.create_connection((self._host, self._port), timeout=max(0.01, deadline - time.monotonic()))
                break
            except OSError as e:  # refused (not listening yet, or gone), unreachable, timed out
                if time.monotonic() >= deadline:
                    raise PeerGone(f"no receiver at {self.address} within {self.timeout}s: {e}") from None
                time.sleep(0.02)
        _tune(s)
        self.sock = s
        self._poll = select.poll()
        self._poll.register(s, select.POLLIN)
        return s

    def _gone(self, why: str) -> PeerGone:
        self._broken = f"receiver at {self.address} disconnected ({why}) with {len(self.link.inflight)} chunk(s) unacknowledged"
        return PeerGone(self._broken)

    # -------------------------------------------------------------- acknowledgements
    def _read_acks(self) -> bool:
        """Read what acknowledgement bytes are here (without waiting) and apply the whole records;
        False when nothing was there."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError as e:
            raise self._gone(str(e)) from None
        if not data:
            raise self._gone("end of stream")
        buf = self._acks
        buf += data
        acks, at = [], 0
        while len(buf) - at >= _ACK.size:
            tag, elen = _ACK.unpack_from(buf, at)
            if len(buf) - at - _ACK.size < elen:
                break
            err = bytes(buf[at + _ACK.size : at + _ACK.size + elen]).decode(errors="replace") if elen else None
            acks.append((tag, err))
            at += _ACK.size + elen
        del buf[:at]
        self.link._acked(acks)
        return True

    def _wait_one_ack(self) -> None:
        deadline = time.monotonic() + self.timeout
        n = len(self.link.inflight)
        while len(self.link.inflight) == n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(left * 1000):
                raise PeerTimeout(f"receiver at {self.address} acknowledged nothing for {self.timeout}s")
            self._read_acks()

    # -------------------------------------------------------------- the contract
    def send(self, header: bytes, payload: memoryview) -> None:
        self.send_many([(header, payload)])

    def send_many(self, frames: list[tuple[bytes, memoryview]]) -> None:
        """One `sendmsg` for as many messages as the window lets out at once (up to `IOV_BATCH`)."""
        sock, link = self._connect(), self.link
        for header, _ in frames:
            if len(header) > MAX_HEAD:
                raise ValueError(f"chunk header of {len(header)} bytes is over the {MAX_HEAD}-byte limit")
        if link.inflight:
            while self._read_acks():
                pass
        i = 0
        while i < len(frames):
            parts, tags = [], []
            while i < len(frames) and len(tags) < IOV_BATCH:
                header, payload = frames[i]
                n = payload.nbytes
                if link._full(n):
                    if tags:
                        break  # send what is open first; the receiver acknowledges it
                    self._wait_one_ack()
                    continue
                tags.append(tag := link._open(None, n))
                parts += (_MSG.pack(tag, len(header), n) + header, payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload)
                i += 1
            try:
                self._send_all(sock, parts)
            except BaseException:
                for tag in tags:
                    link._forget(tag)
                raise

    def _send_all(self, sock: socket.socket, parts: list) -> None:
        """One sendmsg for the whole message in the usual case; where the socket's buffer is full,
        the rest once it drains (bounded by the timeout). A send stopped halfway breaks the link."""
        left = sum(len(p) for p in parts)
        deadline = None
        while True:
            try:
                done = sock.sendmsg(parts, (), socket.MSG_NOSIGNAL)
            except BlockingIOError:
                done = 0
            except OSError as e:
                raise self._gone(str(e)) from None
            left -= done
            if not left:
                return
            while done:  # drop what went out
                if done >= len(parts[0]):
                    done -= len(parts[0])
                    parts.pop(0)
                else:
                    parts[0] = memoryview(parts[0])[done:]
                    done = 0
            deadline = deadline or time.monotonic() + self.timeout
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([], [sock], [], wait)[1]:
                self._broken = f"a send to {self.address} stopped halfway: the receiver read nothing for {self.timeout}s"
                raise PeerTimeout(self._broken)

    def drain(self) -> None:
        if self.link.inflight:
            self._connect()
        while self.link.inflight:
            self._wait_one_ack()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

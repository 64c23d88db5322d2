"""The shared-memory transport's control link: a Unix SOCK_SEQPACKET socket (same host only),
written and read by the calling threads themselves.

Only small messages cross it ([tag + slot + header] one way, coalesced acks the other, both as in
`link`), so what it costs is wake-ups: a message wakes the receiving thread once (a ZeroMQ socket
would hand it from the caller to its I/O thread, to the peer's I/O thread, then to the peer's
caller: three wake-ups a message, each tens of microseconds on a busy host). A peer that exits or
is killed closes its end, so the other side sees it at once.
"""

from __future__ import annotations

import select
import selectors
import socket
import time
import uuid
from collections import deque
from typing import Any

import msgpack

from kvflow.streaming.errors import PeerGone, PeerTimeout
from kvflow.streaming.transports.link import _TAG, CoalescedAcks, Window

MAX_MESSAGE = 1 << 16  # a control message: tag, slot and chunk header (the header's meta included)
_PREFIX = "unix:@"


def _sockaddr(address: str) -> str:
    if not address.startswith(_PREFIX):
        raise ValueError(f"not a shared-memory control address: {address!r} (expected {_PREFIX}NAME)")
    return "\0" + address[len(_PREFIX) :]  # Linux abstract namespace: nothing to clean up on disk


class UnixLinkSender(Window):
    """The `link.Window` contract over a Unix socket: PeerGone when the receiver is unreachable or
    went away, PeerTimeout when acks stop for `timeout` seconds."""

    def __init__(self, address: str, window: int, timeout: float, on_ack=None, window_bytes: int | None = None) -> None:
        super().__init__(address, window, timeout, on_ack, window_bytes)
        self._sockaddr = _sockaddr(address)
        self.sock: socket.socket | None = None  # connected on the first send

    def _connect(self) -> socket.socket:
        if self.sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(self._sockaddr)
            except OSError as e:
                s.close()
                raise PeerGone(f"no receiver at {self.address}: {e}") from None
            s.setblocking(False)  # waits are polls with the timeout (a socket timeout would make every recv wait)
            self.sock = s
            self._poll = select.poll()
            self._poll.register(s, select.POLLIN)
        return self.sock

    def _gone(self, why: str) -> PeerGone:
        return PeerGone(f"receiver at {self.address} disconnected ({why}) with {len(self.inflight)} chunk(s) unacknowledged")

    def _apply(self, body: bytes) -> None:
        if not body:
            raise self._gone("end of stream")
        self._acked(msgpack.unpackb(body))

    def _take_acks(self) -> None:
        """Apply every ack already here, without waiting."""
        while True:
            try:
                body = self.sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                raise self._gone(str(e)) from None
            self._apply(body)

    def _wait_one_ack(self) -> None:
        sock = self._connect()
        if not self._poll.poll(self.timeout * 1000):
            raise PeerTimeout(f"receiver at {self.address} acknowledged nothing for {self.timeout}s")
        try:
            body = sock.recv(MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError as e:
            raise self._gone(str(e)) from None
        self._apply(body)

    def send(self, head: bytes, token: Any = None, nbytes: int = 0) -> None:
        sock = self._connect()
        if self.inflight:
            self._take_acks()
        while self._full(nbytes):
            self._wait_one_ack()
        tag = self._open(token, nbytes)
        msg = _TAG.pack(tag) + head
        try:
            while True:
                try:
                    sock.send(msg)
                    return
                except BlockingIOError:  # its queue is full: wait (bounded) until it reads
                    if not select.select([], [sock], [], self.timeout)[1]:
                        raise PeerTimeout(f"receiver at {self.address} took no message for {self.timeout}s") from None
                except OSError as e:
                    raise self._gone(str(e)) from None
        except BaseException:
            self._forget(tag)
            raise

    def drain(self) -> None:
        while self.inflight:
            self._wait_one_ack()

    def check(self) -> None:
        if self.sock is not None and self.inflight:
            self._take_acks()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class UnixLinkReceiver(CoalescedAcks):
    """Listens on a fresh abstract Unix address (`address`); any number of senders connect."""

    def __init__(self) -> None:
        self.address = f"{_PREFIX}kvflow-{uuid.uuid4().hex}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(_sockaddr(self.address))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.conns: dict[int, socket.socket] = {}  # by a connection id never reused (file descriptors are)
        self._ids: dict[socket.socket, int] = {}
        self._next_id = 0
        self._ready: deque[socket.socket] = deque()  # connections that had input at the last look
        super().__init__()

    def _drop(self, conn: socket.socket) -> None:
        ident = self._ids.pop(conn)
        self._acks.pop(ident, None)
        del self.conns[ident]
        self.sel.unregister(conn)
        conn.close()

    def _select(self, timeout: float | None) -> None:
        for key, _ in self.sel.select(timeout):
            if key.fileobj is self.listener:
                try:
                    conn, _ = self.listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                self._next_id += 1
                self.conns[self._next_id] = conn
                self._ids[conn] = self._next_id
                self.sel.register(conn, selectors.EVENT_READ)
                self._ready.append(conn)
            else:
                self._ready.append(key.fileobj)

    def recv(self, timeout: float | None) -> tuple[int, int, memoryview, list]:
        """(sender id, tag, head, []) of the next message; TimeoutError when none comes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._ready:
                conn = self._ready[0]
                if conn not in self._ids:  # dropped meanwhile
                    self._ready.popleft()
                    continue
                try:
                    msg = conn.recv(MAX_MESSAGE)
                except BlockingIOError:
                    self._ready.popleft()
                    continue
                except OSError:
                    msg = b""
                if not msg:  # the sender closed or died
                    self._ready.popleft()
                    self._drop(conn)
                    continue
                self._ready.rotate(-1)  # take turns between senders
                ident = self._ids[conn]
                if len(msg) < _TAG.size:
                    return ident, -1, memoryview(b""), []
                return ident, _TAG.unpack_from(msg)[0], memoryview(msg)[_TAG.size :], []
            self.flush_acks()  # about to wait: nothing may hold a sender up
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no chunk at {self.address} within {timeout}s")
            self._select(left)

    def _known(self, ident: int) -> bool:
        return ident in self.conns

    def _has_input(self, ident: int) -> bool:
        try:
            return bool(self.conns[ident].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # (BlockingIOError included: nothing there)
            return False

    def _send_ack_batch(self, ident: int, acks: list) -> None:
        conn = self.conns.get(ident)
        if conn is not None:
            try:
                conn.send(msgpack.packb(acks))
            except OSError:  # gone, or its buffer is full because it stopped reading: it will time out
                pass

    def close(self) -> None:
        self.flush_acks()
        for conn in list(self.conns.values()):
            self._drop(conn)
        self.sel.unregister(self.listener)
        self.listener.close()
        self.sel.close()

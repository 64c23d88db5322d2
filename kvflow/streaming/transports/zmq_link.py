"""The ZeroMQ plumbing TCP and shared memory share: tagged messages, windowed (coalesced) acks,
disconnect detection.

A message is [tag (8 bytes) + head] followed by at most one payload frame. The receiver answers
with [ident, msgpack [[tag, error], ...]]: acknowledgements are coalesced while more messages are
already waiting (ACK_BATCH at most), and sent at once when the receiver runs dry, rejects one, or
the sender marked the message URGENT (its window is full: it waits for an ack to send more):
on a busy host each message that wakes a peer costs tens of microseconds.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvflow.streaming.errors import PeerGone, PeerRejected, PeerTimeout

_TAG = struct.Struct("<Q")
URGENT = 1 << 63  # tag bit: acknowledge this message at once
ACK_BATCH = 8  # the most acknowledgements a receiver holds back while it has messages queued


class LinkSender:
    """A DEALER connected to one receiver. At most `window` messages and (beyond the first two)
    `window_bytes` payload bytes are unacknowledged at a time; `on_ack(token)` runs for each
    acknowledged message. Fails with PeerGone on a disconnect (seen via a socket monitor whenever
    it waits, so a killed receiver is noticed at once) and PeerTimeout when acks stop."""

    def __init__(self, address: str, window: int, timeout: float, on_ack=None, window_bytes: int | None = None) -> None:
        if window <= 0 or timeout <= 0 or (window_bytes is not None and window_bytes <= 0):
            raise ValueError(f"window, window_bytes and timeout must be positive ({window}, {window_bytes}, {timeout})")
        self.address = address
        self.window = window
        self.window_bytes = window_bytes or 1 << 62
        self.inflight_bytes = 0
        self.timeout = timeout
        self.on_ack = on_ack
        self.ctx = zmq.Context.instance()  # shared and never terminated: no term() hang at GC
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, so sends to nobody time out
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 500)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2000)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.inflight: dict[int, tuple[Any, int]] = {}  # tag -> (token, payload bytes)
        self._next_tag = 0
        self._tracker = None
        self._connected = False
        self._gone: str | None = None

    def _poll_monitor(self) -> None:
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)["event"]
            if ev == zmq.EVENT_CONNECTED:
                self._connected = True
            elif ev == zmq.EVENT_DISCONNECTED and self._connected:
                self._gone = f"receiver at {self.address} disconnected"

    def check(self) -> None:
        self._poll_monitor()
        if self._gone:
            raise PeerGone(self._gone + f" with {len(self.inflight)} chunk(s) unacknowledged")

    def _take_acks(self, flags: int = 0) -> bool:
        """Apply one ack message (waiting for it unless flags is NOBLOCK); False when none was there."""
        try:
            body = self.sock.recv(flags)
        except zmq.Again:
            return False
        error = None
        for tag, err in msgpack.unpackb(body):
            if tag not in self.inflight:
                continue  # not ours (a confused receiver): nothing to free
            token, nbytes = self.inflight.pop(tag)
            self.inflight_bytes -= nbytes
            if self.on_ack is not None:
                self.on_ack(token)
            error = error or err
        if error is not None:
            raise PeerRejected(f"receiver at {self.address} rejected a chunk: {error}")
        return True

    def _wait_one_ack(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            self.check()
            if self._take_acks(zmq.NOBLOCK):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"receiver at {self.address} acknowledged nothing for {self.timeout}s")
            self.poller.poll(left * 1000)

    def _full(self, nbytes: int) -> bool:
        n = len(self.inflight)
        return n >= self.window or (n >= 2 and self.inflight_bytes + nbytes > self.window_bytes)

    def send(self, head: bytes, payload=None, token: Any = None, copy: bool = True, nbytes: int | None = None, track: bool = False) -> None:
        """Send head (and payload, a buffer); `nbytes` (default: the payload's size) counts
        against window_bytes. With copy=False ZeroMQ reads the payload in place after this
        returns: the caller must not reuse it before `token` comes back through on_ack."""
        if nbytes is None:
            nbytes = 0 if payload is None else memoryview(payload).nbytes
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # acks already here: free their slots / buffers first
            self._take_acks()
        while self._full(nbytes):
            self._wait_one_ack()
        tag = self._next_tag
        self._next_tag += 1
        n = len(self.inflight) + 1  # urgent when the next message of this size would wait for acks
        urgent = n >= self.window or (n >= 2 and self.inflight_bytes + 2 * nbytes > self.window_bytes)
        try:
            if payload is None:
                self.sock.send(_TAG.pack(tag | URGENT if urgent else tag) + head)
            else:
                self.sock.send(_TAG.pack(tag | URGENT if urgent else tag) + head, zmq.SNDMORE)
                self._tracker = self.sock.send(payload, copy=copy, track=track)
        except zmq.Again:
            self.check()
            raise PeerGone(f"no receiver connected at {self.address} within {self.timeout}s") from None
        self.inflight[tag] = (token, nbytes)
        self.inflight_bytes += nbytes

    def send_in_place(self, head: bytes, payload) -> None:
        """Send without copying the payload, returning once ZeroMQ no longer reads it (so the
        caller may reuse it): PeerTimeout if that takes longer than `timeout`."""
        self.send(head, payload, copy=False, track=True)
        deadline = time.monotonic() + self.timeout
        while not self._tracker.done:
            self.check()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"a {self.address} send did not complete within {self.timeout}s")
            try:
                self._tracker.wait(0.05)
            except zmq.NotDone:
                pass
        self._tracker = None

    def drain(self) -> None:
        while self.inflight:
            self._wait_one_ack()
        self.check()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class CoalescedAcks:
    """The receiver's side of the acknowledgement protocol (module docstring), for any link:
    acknowledgements per sender are held back while more messages wait, up to ACK_BATCH, and sent
    at once on a rejection, an URGENT tag or when the receiver runs dry. A link provides
    `_known(ident)`, `_has_input(ident)` and `_send_ack_batch(ident, body)`."""

    def __init__(self) -> None:
        self._acks: dict = {}

    def _known(self, ident) -> bool:
        return True

    def _has_input(self, ident) -> bool:
        raise NotImplementedError

    def _send_ack_batch(self, ident, body: bytes) -> None:
        raise NotImplementedError

    def ack(self, ident, tag: int, error: str | None) -> None:
        """Acknowledge (error None) or reject a message (tag as received)."""
        if tag < 0 or not self._known(ident):
            return
        pending = self._acks.setdefault(ident, [])
        pending.append((tag & ~URGENT, error))
        if error is not None or tag & URGENT or len(pending) >= ACK_BATCH or not self._has_input(ident):
            self._send_acks(ident)

    def _send_acks(self, ident) -> None:
        pending = self._acks.pop(ident, None)
        if pending:
            self._send_ack_batch(ident, msgpack.packb(pending))

    def flush_acks(self) -> None:
        for ident in list(self._acks):
            self._send_acks(ident)


class LinkReceiver(CoalescedAcks):
    """A ROUTER bound to a free port (or the given one); many senders may connect to it."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.ctx = zmq.Context.instance()  # shared and never terminated: no term() hang at GC
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            self.sock.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        super().__init__()

    def recv(self, timeout: float | None) -> tuple[bytes, int, memoryview, list[zmq.Frame]]:
        """(sender identity, tag, head, remaining frames) of the next message; TimeoutError when
        none comes. A message too short to carry a tag gets tag -1 and an empty head."""
        try:
            ident, first, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.flush_acks()  # about to wait: nothing may hold a sender up
            if not self.sock.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError(f"no chunk at {self.address} within {timeout}s") from None
            ident, first, *frames = self.sock.recv_multipart(copy=False)
        head = first.buffer
        if len(head) < _TAG.size:
            return ident.bytes, -1, memoryview(b""), frames
        return ident.bytes, _TAG.unpack_from(head)[0], head[_TAG.size :], frames

    def _has_input(self, ident: bytes) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _send_ack_batch(self, ident: bytes, body: bytes) -> None:
        try:
            self.sock.send_multipart([ident, body], zmq.NOBLOCK)
        except zmq.ZMQError:  # that sender is gone (ROUTER drops unroutable messages)
            pass

    def close(self) -> None:
        self.flush_acks()
        self.sock.close(0)

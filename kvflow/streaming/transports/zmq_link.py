"""The ZeroMQ plumbing TCP and shared memory share: tagged frames, windowed acks, disconnect detection."""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvflow.streaming.errors import PeerGone, PeerRejected, PeerTimeout

_TAG = struct.Struct("<Q")


class LinkSender:
    """A DEALER connected to one receiver. At most `window` frames are unacknowledged at a time;
    `on_ack(token)` runs for each acknowledged frame. Fails with PeerGone on a disconnect (seen via
    a socket monitor, so a killed receiver is noticed at once) and PeerTimeout when acks stop."""

    def __init__(self, address: str, window: int, timeout: float, on_ack=None) -> None:
        if window <= 0 or timeout <= 0:
            raise ValueError(f"window and timeout must be positive ({window}, {timeout})")
        self.address = address
        self.window = window
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
        self.inflight: dict[int, Any] = {}
        self._next_tag = 0
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

    def _wait_one_ack(self) -> None:
        deadline = time.monotonic() + self.timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"receiver at {self.address} acknowledged nothing for {self.timeout}s")
            if self.sock in dict(poller.poll(left * 1000)):
                tag_frame, status = self.sock.recv_multipart()
                token = self.inflight.pop(_TAG.unpack(tag_frame)[0])
                if self.on_ack is not None:
                    self.on_ack(token)
                error = msgpack.unpackb(status)
                if error is not None:
                    raise PeerRejected(f"receiver at {self.address} rejected a chunk: {error}")
                return

    def send(self, frames: list, token: Any = None) -> None:
        """Send frames (bytes or buffers); they are copied or fully handed to the kernel on return."""
        self.check()
        while len(self.inflight) >= self.window:
            self._wait_one_ack()
        tag = self._next_tag
        self._next_tag += 1
        big = any(memoryview(f).nbytes >= 1 << 16 for f in frames)
        try:
            tracker = self.sock.send_multipart([_TAG.pack(tag), *frames], copy=not big, track=big)
        except zmq.Again:
            self.check()
            raise PeerGone(f"no receiver connected at {self.address} within {self.timeout}s") from None
        self.inflight[tag] = token
        if big:  # zero-copy send: the caller's buffer is in use until ZeroMQ lets go of it
            deadline = time.monotonic() + self.timeout
            while not tracker.done:
                self.check()
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"a {self.address} send did not complete within {self.timeout}s")
                try:
                    tracker.wait(0.05)
                except zmq.NotDone:
                    pass

    def drain(self) -> None:
        while self.inflight:
            self._wait_one_ack()
        self.check()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class LinkReceiver:
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

    def recv(self, timeout: float | None) -> tuple[bytes, bytes, list[zmq.Frame]]:
        """(sender identity, tag, remaining frames) of the next message; TimeoutError when none comes."""
        if not self.sock.poll(None if timeout is None else timeout * 1000):
            raise TimeoutError(f"no chunk at {self.address} within {timeout}s")
        ident, tag, *frames = self.sock.recv_multipart(copy=False)
        return ident.bytes, tag.bytes, frames

    def ack(self, ident: bytes, tag: bytes, error: str | None) -> None:
        self.sock.send_multipart([ident, tag, msgpack.packb(error)])

    def close(self) -> None:
        self.sock.close(0)

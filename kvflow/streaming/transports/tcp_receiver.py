"""The TCP transport's receiving side (see `tcp` for the framing): `TcpReceiver` accepts any
number of senders on one port, reads each payload into a buffer of its pool and takes messages from
the connections in turn.

A receiver's port is open to anyone who can reach the internal interface, so a stranger costs it
little: once its `InStream` holds the cluster secret (`check_headers`), each header's MAC is checked
before any payload buffer is taken (a header that fails it is handed out with no payload, so
rejected, and its payload bytes are read and dropped); a connection is *pending* until one of its
headers passes, and while pending its buffer grows only with the bytes it really sent (a header of
at most `MAX_PENDING_HEAD`), at most `max_pending` connections are pending at once (the oldest is
dropped for a new one) and each is dropped `auth_timeout` seconds after it connected.

A receiver that writes into a cache on a CUDA device takes page-locked buffers (`pinned`), so a
payload goes from the socket to the device by DMA, not through pageable memory staged by the driver.
"""

from __future__ import annotations

import select
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from kvflow.streaming.transport import ChunkReceiver, RawChunk
from kvflow.streaming.transports.link import CoalescedAcks
from kvflow.streaming.transports.tcp import _ACK, _MSG, MAX_HEAD, _tune

MAX_PENDING_HEAD = 1 << 20  # the same as `MAX_HEAD` before the connection has sent an authentic header
MAX_PENDING = 32  # connections without an authentic header yet, at once (the oldest is dropped for a new one)
AUTH_TIMEOUT_S = 5.0  # a connection that sent no authentic header within this long is dropped
PENDING_INBOX = 4096  # a pending connection's first read buffer; it grows only as its bytes arrive
MAX_PAYLOAD = 1 << 31  # a longer payload is read and dropped, the chunk handed out empty (so rejected)
INBOX = 256 << 10  # bytes read at a time while looking for the next message
POOL_BYTES = 64 << 20  # receive buffers a receiver keeps for reuse, at most


class _Buffers:
    """Receive buffers by power-of-two size class, the most recently released first (warm in
    cache); at most `limit` bytes of them kept; page-locked with `pinned` (CUDA)."""

    def __init__(self, limit: int = POOL_BYTES, pinned: bool = False) -> None:
        self.free: dict[int, list[np.ndarray]] = {}
        self.kept = 0
        self.limit = limit
        self.pinned = pinned

    def take(self, n: int) -> np.ndarray:
        size = max(4096, 1 << (n - 1).bit_length())
        free = self.free.get(size)
        if free:
            self.kept -= size
            return free.pop()
        if self.pinned:  # (the array keeps the tensor, and so its page-locked memory, alive)
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        if self.kept + buf.size <= self.limit:
            self.free.setdefault(buf.size, []).append(buf)
            self.kept += buf.size


class _Closed(Exception):
    """The sender closed its end, died, or broke the framing."""


class _Conn:
    """One sender's connection: reads messages without blocking, resuming a partial one later. It is
    pending (`authenticated` False) until a header passes `check` (any header, without one)."""

    def __init__(self, sock: socket.socket, ident: int, pool: _Buffers, check: Callable[[bytes], bool] | None) -> None:
        self.sock, self.ident, self.pool, self.check = sock, ident, pool, check
        self.accepted = time.monotonic()
        self.authenticated = False
        self.inbox = bytearray(PENDING_INBOX)
        self.lo = self.hi = 0  # unparsed bytes: inbox[lo:hi]
        self.msg: list | None = None  # [tag, head, buffer, payload length, bytes read]
        self.skip = 0  # bytes of a refused payload still to be read and dropped

    def _fill(self, limit: int = INBOX) -> None:
        """Read what is there, up to `limit` bytes, after the unparsed ones (BlockingIOError: nothing yet). A full
        inbox first moves its unparsed bytes to the front, or doubles when they fill it: it never holds much more
        than twice what the peer sent."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.inbox):
            if self.lo:
                self.inbox[: self.hi - self.lo] = self.inbox[self.lo : self.hi]
                self.lo, self.hi = 0, self.hi - self.lo
            else:
                self.inbox += bytes(len(self.inbox))
        n = self.sock.recv_into(memoryview(self.inbox)[self.hi : self.hi + limit])
        if not n:
            raise _Closed("end of stream")
        self.hi += n

    def has_input(self) -> bool:
        """Whether more of a message is here, reading the start of the next one if need be (where a
        peek would cost the same system call and read nothing)."""
        if self.hi > self.lo or self.msg is not None or self.skip:
            return True
        try:
            self._fill(4096)
            return True
        except (BlockingIOError, _Closed):  # (a close is found by the next read)
            return False
        except OSError:
            return False

    def _authentic(self, head: bytes) -> bool:
        if self.check is not None and not self.check(head):
            return False
        if not self.authenticated:
            self.authenticated = True
            if len(self.inbox) < INBOX:  # a peer with the secret: full-size reads from now on
                self.inbox += bytes(INBOX - len(self.inbox))
        return True

    def next(self) -> tuple[int, bytes, memoryview, np.ndarray | None] | None:
        """The next whole message (tag, header, payload view, its buffer), or None until more arrives."""
        try:
            while self.skip:
                n = self.sock.recv_into(self.inbox, min(self.skip, len(self.inbox)))
                if not n:
                    raise _Closed("end of stream")
                self.skip -= n
            if self.msg is None:
                while self.hi - self.lo < _MSG.size:
                    self._fill()
                tag, hlen, plen = _MSG.unpack_from(self.inbox, self.lo)
                if hlen > (MAX_HEAD if self.authenticated else MAX_PENDING_HEAD):
                    raise _Closed(f"a {hlen}-byte header")
                need = _MSG.size + hlen
                while self.hi - self.lo < need:
                    self._fill()
                end = self.lo + need
                head = bytes(memoryview(self.inbox)[self.lo + _MSG.size : end])
                k = min(self.hi - end, plen)
                self.lo = end + k
                if not self._authentic(head) or plen > MAX_PAYLOAD:  # refused: handed out empty (so rejected),
                    self.skip = plen - k                               # the bytes dropped, no buffer taken
                    return tag, head, memoryview(b""), None
                buf = self.pool.take(plen)
                if k:
                    buf[:k] = np.frombuffer(self.inbox, dtype=np.uint8, count=k, offset=end)
                self.msg = [tag, head, buf, plen, k]
            tag, head, buf, plen, got = msg = self.msg
            if got < plen:
                view = memoryview(buf)
                while got < plen:
                    n = self.sock.recv_into(view[got:], plen - got)
                    if not n:
                        raise _Closed("end of stream")
                    got += n
                    msg[4] = got
            self.msg = None
            return tag, head, memoryview(buf)[:plen], buf
        except BlockingIOError:
            return None
        except OSError as e:
            raise _Closed(str(e)) from None

    def close(self) -> None:
        if self.msg is not None:
            self.pool.give(self.msg[2])
        self.msg = None
        self.sock.close()


class TcpReceiver(CoalescedAcks, ChunkReceiver):
    """Binds `host` on a free port (or `port`); `address` is what senders connect to, any number of
    them. A payload is a view of a receive buffer (no copy after the socket's), valid until the
    chunk is released. At most `max_pending` connections without an authentic header are kept, each
    for at most `auth_timeout` seconds (module docstring)."""

    # An acknowledgement that frees the sender's socket buffer wakes it (tens of microseconds each
    # on a busy host): one per 32 chunks instead of 8 moved 64 KB chunks 25-40 % faster here, and a
    # sender's window (64 chunks) still has room while they are held back.
    ack_batch = 32

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, max_pending: int = MAX_PENDING,
                 auth_timeout: float = AUTH_TIMEOUT_S, pinned: bool = False) -> None:
        if max_pending <= 0 or auth_timeout <= 0:
            raise ValueError(f"max_pending and auth_timeout must be positive ({max_pending}, {auth_timeout})")
        super().__init__()
        self.max_pending, self.auth_timeout = max_pending, auth_timeout
        self.check: Callable[[bytes], bool] | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port or 0), family=family, backlog=128)
        self.listener.setblocking(False)
        self.address = f"tcp://{host}:{self.listener.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.pool = _Buffers(pinned=pinned)
        self.conns: dict[int, _Conn] = {}  # by a connection id never reused (file descriptors are)
        self.pending: dict[int, _Conn] = {}  # the connections not yet authenticated, oldest first
        self.refused = 0  # pending connections dropped (too many at once, or too slow to authenticate)
        self._next_id = 0
        self._ready: deque[_Conn] = deque()  # connections that had input at the last look

    def check_headers(self, authentic: Callable[[bytes], bool]) -> None:
        self.check = authentic

    def _drop(self, conn: _Conn) -> None:
        self.pending.pop(conn.ident, None)
        if self.conns.pop(conn.ident, None) is not None:
            self._acks.pop(conn.ident, None)
            self.sel.unregister(conn.sock)
            conn.close()

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        if len(self.pending) >= self.max_pending:  # the oldest gives way: a flood cannot keep a new peer out
            self.refused += 1
            self._drop(next(iter(self.pending.values())))
        _tune(sock)
        self._next_id += 1
        conn = self.conns[self._next_id] = self.pending[self._next_id] = _Conn(sock, self._next_id, self.pool, self.check)
        self.sel.register(sock, selectors.EVENT_READ, conn)
        self._ready.append(conn)

    def _expire(self) -> None:
        """Drop the pending connections past `auth_timeout`; one whose input has not been read yet gets as
        long again (a busy receiver must not drop a peer whose header is waiting in the socket)."""
        now = time.monotonic()
        for conn in list(self.pending.values()):
            late = now - conn.accepted - self.auth_timeout
            if late < 0:
                break  # the rest connected later
            if late < self.auth_timeout and conn in self._ready:
                continue
            self.refused += 1
            self._drop(conn)

    def _select(self, timeout: float | None) -> None:
        if self.pending:  # wake up in time to drop the first pending connection that fails to authenticate
            first = next(iter(self.pending.values())).accepted + self.auth_timeout - time.monotonic()
            timeout = max(0.0, first if timeout is None else min(timeout, first))
        for key, _ in self.sel.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            else:
                self._ready.append(key.data)
        if self.pending:
            self._expire()

    def recv(self, timeout: float | None = None) -> RawChunk:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if (chunk := self._next_ready()) is not None:
                return chunk
            self.flush_acks()  # about to wait: nothing may hold a sender up
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no chunk at {self.address} within {timeout}s")
            self._select(left)

    def recv_many(self, max_chunks: int, timeout: float | None = None) -> list[RawChunk]:
        got = [self.recv(timeout)]
        while len(got) < max_chunks and (chunk := self._next_ready()) is not None:  # what was read already, or is readable now
            got.append(chunk)
        return got

    def _next_ready(self) -> RawChunk | None:
        """The next whole message of a connection that had input at the last look (reading on
        without waiting), or None when none has one."""
        while self._ready:
            conn = self._ready[0]
            if conn.ident not in self.conns:  # dropped meanwhile
                self._ready.popleft()
                continue
            try:
                msg = conn.next()
            except _Closed:
                self._ready.popleft()
                self._drop(conn)
                continue
            if conn.authenticated and conn.ident in self.pending:
                del self.pending[conn.ident]
            if msg is None:
                self._ready.popleft()
                continue
            self._ready.rotate(-1)  # take turns between senders
            return self._chunk(conn.ident, *msg)
        return None

    def _chunk(self, ident: int, tag: int, head: bytes, payload: memoryview, buf: np.ndarray | None) -> RawChunk:
        def release(err: str | None) -> None:
            self.ack(ident, tag, err)
            if buf is not None:
                self.pool.give(buf)

        return RawChunk(head, payload, release)

    # -------------------------------------------------------------- acknowledgements (CoalescedAcks)
    def _known(self, ident: int) -> bool:
        return ident in self.conns

    def _has_input(self, ident: int) -> bool:
        conn = self.conns[ident]
        if not conn.has_input():
            return False
        # has_input may have read the start of the next message off the socket: the selector will not
        # report those bytes again, so the connection goes back on the ready list (else a message
        # that arrived while its sender's previous one was being acknowledged waited for the next
        # byte on that socket, or for ever when none came: a request's hand-off KV never completed)
        if conn not in self._ready:
            self._ready.append(conn)
        return True

    def _send_ack_batch(self, ident: int, acks: list) -> None:
        conn = self.conns.get(ident)
        if conn is None:
            return
        body = b"".join(_ACK.pack(tag, 0) if err is None else _ACK.pack(tag, len(e := err.encode()[:4096])) + e for tag, err in acks)
        try:
            sent = conn.sock.send(body, socket.MSG_NOSIGNAL)
            while sent < len(body):  # its buffer is full (it is not reading): a moment, then give up on it
                if not conn.authenticated or not select.select([], [conn.sock], [], 1.0)[1]:
                    raise OSError("acknowledgements not read")
                sent += conn.sock.send(memoryview(body)[sent:], socket.MSG_NOSIGNAL)
        except BlockingIOError:  # nothing fits: it stopped reading, and will time out
            pass
        except OSError:  # gone, or a half-sent acknowledgement: the stream is out of step
            self._drop(conn)

    def close(self) -> None:
        self.flush_acks()
        for conn in list(self.conns.values()):
            self._drop(conn)
        self.sel.unregister(self.listener)
        self.listener.close()
        self.sel.close()

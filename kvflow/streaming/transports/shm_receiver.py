"""The shared-memory transport's receiving side (see `shm` for the protocol): `ShmReceiver` listens
on a Unix socket, maps each connecting sender's segment and takes chunks from their descriptor
rings in turn, blocking on the sockets only when every ring is empty."""

from __future__ import annotations

import mmap
import select
import socket
import threading
import time
import uuid
from collections import deque

import numpy as np

from kvflow.streaming.transport import ChunkReceiver, RawChunk
from kvflow.streaming.transports.shm_segment import (
    ACCEPTED,
    ADDRESS_PREFIX,
    DATA_START,
    DESCRIPTORS,
    ERR_LEN,
    ERROR_ROOM,
    HEAD,
    REJECTED,
    RELEASED,
    RX_SLEEPING,
    SPIN_S,
    STATE,
    TX_WAKE_AT,
    attach,
    control_views,
    fence,
    sockaddr,
    spin,
)


class _Peer:
    """The receiver's view of one connected sender: its socket, and its segment once named."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seg: mmap.mmap | None = None
        self.tail = 0  # descriptors taken
        self.closing = False  # its socket ended: dropped once its published chunks are taken
        self.alive = True

    def attach(self, name: str) -> None:
        self.seg = attach(name)  # (the sender owns and unlinks the segment)
        self.ctl, self.desc = control_views(self.seg)
        self.data = memoryview(self.seg)[DATA_START:]
        self.bytes = np.frombuffer(self.seg, dtype=np.uint8)[DATA_START:]

    def ready(self) -> bool:
        return self.seg is not None and self.ctl[HEAD] > self.tail


class ShmReceiver(ChunkReceiver):
    """Listens on a fresh abstract Unix address (`address`); any number of senders connect, each
    with its own segment. Polls the senders' descriptor rings in turn and blocks on their sockets
    only when all are empty."""

    POLL_EVERY = 32  # chunks taken between looks for new senders and closed ones while busy

    def __init__(self) -> None:
        self.address = f"{ADDRESS_PREFIX}kvflow-{uuid.uuid4().hex}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(sockaddr(self.address))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.poll = select.poll()
        self.poll.register(self.listener, select.POLLIN)
        self.peers: dict[int, _Peer] = {}  # by file descriptor, while connected
        self.order: deque[_Peer] = deque()  # taking turns
        self._lock = threading.Lock()  # releases may come from several threads
        self._since_poll = 0
        self._last_take = 0.0

    @property
    def segments(self) -> dict[int, mmap.mmap]:
        return {fd: p.seg for fd, p in self.peers.items() if p.seg is not None}

    def _drop(self, peer: _Peer) -> None:
        with self._lock:  # not while another thread releases one of its chunks
            peer.alive = False
            del self.peers[peer.sock.fileno()]
            self.order.remove(peer)
            if not peer.closing:
                self.poll.unregister(peer.sock)
            peer.sock.close()
            if peer.seg is not None:
                peer.ctl = peer.desc = peer.bytes = None
                try:
                    peer.data.release()
                    peer.seg.close()
                except BufferError:  # a caller still holds a view; the mapping goes with the process
                    pass

    def _events(self, timeout_ms: float | None) -> bool:
        """Accept new senders and read what their sockets hold (segment names, wake-ups, ends);
        True if anything happened."""
        events = self.poll.poll(timeout_ms)
        for fd, _ in events:
            if fd == self.listener.fileno():
                try:
                    sock, _ = self.listener.accept()
                except BlockingIOError:
                    continue
                sock.setblocking(False)
                peer = self.peers[sock.fileno()] = _Peer(sock)
                self.order.append(peer)
                self.poll.register(sock, select.POLLIN)
                fd = sock.fileno()
            peer = self.peers.get(fd)
            if peer is None:
                continue
            while True:
                try:
                    msg = peer.sock.recv(1024)
                except BlockingIOError:
                    break
                except OSError:
                    msg = b""
                if not msg:
                    peer.closing = True
                    self.poll.unregister(peer.sock)
                    break
                if peer.seg is None:
                    try:
                        peer.attach(msg.decode())
                    except (OSError, ValueError, UnicodeDecodeError):  # not a sender of ours
                        peer.closing = True
                        self.poll.unregister(peer.sock)
                        break
        for peer in [p for p in self.order if p.closing and not p.ready()]:
            self._drop(peer)
        return bool(events)

    def recv(self, timeout: float | None = None) -> RawChunk:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._since_poll += 1
            if self._since_poll >= self.POLL_EVERY:
                self._since_poll = 0
                self._events(0)
            for _ in range(len(self.order)):
                peer = self.order[0]
                self.order.rotate(-1)
                if peer.ready():
                    return self._take(peer)
            if self._spin():
                continue
            # nothing published: say so in every segment, look once more, then block
            sleepers = [p for p in self.order if p.seg is not None]
            for p in sleepers:
                p.ctl[RX_SLEEPING] = 1
            fence()
            if not any(p.ready() for p in sleepers):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    for p in sleepers:
                        p.ctl[RX_SLEEPING] = 0
                    raise TimeoutError(f"no chunk at {self.address} within {timeout}s")
                self._events(None if left is None else left * 1000)
            for p in sleepers:
                if p.alive:
                    p.ctl[RX_SLEEPING] = 0
            self._since_poll = 0

    def recv_many(self, max_chunks: int, timeout: float | None = None) -> list[RawChunk]:
        got = [self.recv(timeout)]
        while len(got) < max_chunks:
            for _ in range(len(self.order)):
                peer = self.order[0]
                self.order.rotate(-1)
                if peer.ready():
                    got.append(self._take(peer))
                    break
            else:
                break
        return got

    def _spin(self) -> bool:
        """Poll the rings a while (`spin`) when the last chunk came within `SPIN_S`: a busy stream."""
        left = self._last_take + SPIN_S - time.monotonic()
        return left > 0 and spin(lambda: any(p.ready() for p in self.order), left)

    def _take(self, peer: _Peer) -> RawChunk:
        self._last_take = time.monotonic()
        i = peer.tail % DESCRIPTORS
        peer.tail += 1
        seq, poff, plen, hoff, hlen, _, _, _ = peer.desc[i].tolist()
        size = len(peer.data)
        if seq != peer.tail - 1 or not (0 <= poff <= poff + plen <= size and 0 <= hoff <= hoff + max(hlen, ERROR_ROOM) <= size):
            # not a descriptor this sender wrote: rejected (without an error text, nowhere safe to put it)
            self._release(peer, i, None, f"bad shared-memory descriptor #{seq}")
            return RawChunk(b"", memoryview(b""))
        view = peer.data[poff : poff + plen]
        return RawChunk(bytes(peer.data[hoff : hoff + hlen]), view, lambda err: self._release(peer, i, hoff, err, view))

    def _release(self, peer: _Peer, i: int, room: int | None, err: str | None, view: memoryview | None = None) -> None:
        """Mark descriptor `i` accepted or rejected (the error written over its header range at
        `room`), count it released, and wake the sender if it sleeps until this count."""
        with self._lock:
            if peer.alive:
                if err is not None and room is not None:
                    text = err.encode()[:ERROR_ROOM]
                    peer.bytes[room : room + len(text)] = np.frombuffer(text, dtype=np.uint8)
                    peer.desc[i, ERR_LEN] = len(text)
                peer.desc[i, STATE] = ACCEPTED if err is None else REJECTED
                released = int(peer.ctl[RELEASED]) + 1
                peer.ctl[RELEASED] = released
                fence()
                wake = peer.ctl[TX_WAKE_AT]
                if wake and released >= wake:
                    peer.ctl[TX_WAKE_AT] = 0
                    try:
                        peer.sock.send(b"a")
                    except OSError:  # wake-ups already queued, or gone (its end is read by recv)
                        pass
        if view is not None:
            try:
                view.release()
            except BufferError:  # the caller still holds a tensor over the slot
                pass

    def close(self) -> None:
        for peer in list(self.order):
            self._drop(peer)
        self.poll.unregister(self.listener)
        self.listener.close()

"""Shared-memory transport (same host): a chunk's payload and header sit in a per-sender segment,
and so do the descriptors that announce them and the acknowledgements that free them; a Unix socket
beside it carries only the segment's name and wake-ups.

The segment is [control words | descriptor ring | data]. The sender copies (or packs, through
`reserve()`) a payload and its header into ranges of the data area, fills the descriptor of the
chunk's sequence number and publishes it by advancing `HEAD`; the receiver polls `HEAD`, reads the
header, hands out a view of the payload in place and, on release, marks the descriptor accepted or
rejected (with the error text) and advances `RELEASED`. Nothing crosses the socket while both sides
keep up: a side about to block says so in the segment first (the receiver sets `RX_SLEEPING`, the
sender `TX_WAKE_AT`, the `RELEASED` count it waits for), re-checks, then blocks on the socket; the
other side publishes first, then checks the flag and sends one wake-up byte — the classic sleeping
consumer, with a full memory fence between the store and the re-check on each side (x86-TSO keeps
everything else in order). A peer that exits or is killed closes its end of the socket, which wakes
and fails the other side at once.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
import uuid
from collections import deque
from multiprocessing import shared_memory

import _posixshmem
import numpy as np
import torch

from kvflow.streaming.errors import ChunkOversized, PeerGone, PeerTimeout
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk, buffer_address
from kvflow.streaming.transports.link import URGENT, Window

ALIGN = 64
WINDOW_BYTES = 4 << 20  # payload bytes in flight beyond two chunks (see ShmSender)
DESCRIPTORS = 256  # descriptor ring entries: the most chunks in flight, whatever the window
HEADER_ROOM = 4096  # bytes `reserve()` keeps after the payload for the chunk's header
ERROR_ROOM = 256  # a header takes at least this much room: a rejection's text is written over it
_PREFIX = "unix:@"
SPIN_S = 250e-6  # how long a side that has to wait polls the segment before it sleeps (see `_spin`)

# control words (int64), sender's and receiver's on separate cache lines
HEAD, TX_WAKE_AT = 0, 1  # written by the sender: descriptors published; RELEASED count it sleeps until (0: awake)
RX_SLEEPING, RELEASED = 8, 9  # written by the receiver: 1 while it blocks; descriptors released
CONTROL_WORDS = 16
# a descriptor (8 int64, one cache line): sequence number, payload range, header range, state, error length
SEQ, PAY_OFF, PAY_LEN, HEAD_OFF, HEAD_LEN, STATE, ERR_LEN = range(7)
PENDING, ACCEPTED, REJECTED = 0, 1, 2
_DATA_START = (CONTROL_WORDS + 8 * DESCRIPTORS) * 8

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: the lock's atomic read-modify-write (a locked instruction on x86)
    orders this thread's earlier stores before its later loads, which x86-TSO alone does not."""
    _fence_lock.acquire()
    _fence_lock.release()


def _spin(done, seconds: float = SPIN_S) -> bool:
    """Poll `done()` for up to `seconds`, yielding the core (and the GIL) between looks; whether
    it came true. A peer that keeps up is likelier to be a few tens of microseconds away than worth
    a wake-up (the other side's system call and this thread's wake, which on a loaded host cost as
    much as copying a megabyte)."""
    until = time.monotonic() + seconds
    while not done():
        if time.monotonic() > until:
            return False
        os.sched_yield()
    return True


def _sockaddr(address: str) -> str:
    if not address.startswith(_PREFIX):
        raise ValueError(f"not a shared-memory control address: {address!r} (expected {_PREFIX}NAME)")
    return "\0" + address[len(_PREFIX) :]  # Linux abstract namespace: nothing to clean up on disk


class _Ring:
    """First-in first-out allocation of byte ranges in a segment of `size` bytes. A range is
    [offset, end, done]; space comes back once it and every range allocated before it are done.
    Allocation goes back to offset 0 as soon as there is room there, so a receiver that keeps up
    keeps the sender writing the same few (cached) ranges rather than walking the whole segment."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.head = 0
        self.live: deque[list] = deque()

    def alloc(self, n: int) -> list | None:
        n = -(-n // ALIGN) * ALIGN  # ranges start on cache lines
        if not self.live:
            self.head = 0
        tail = self.live[0][0] if self.live else self.size
        if self.live and self.head <= tail:  # wrapped: the free space is [head, tail)
            off = self.head if tail - self.head >= n else None
        elif tail >= n:  # free: [0, tail) and [head, size); the low end first, likelier in cache
            off = 0
        else:
            off = self.head if self.size - self.head >= n else None
        if off is None:
            return None
        r = [off, off + n, False]
        self.live.append(r)
        self.head = off + n
        return r

    def free(self, r: list) -> None:
        r[2] = True
        while self.live and self.live[0][2]:
            self.live.popleft()


class ShmSender(ChunkSender):
    """Owns a segment with `slots` x `slot_bytes` of data (named uniquely per instance, unlinked on
    close); a chunk is at most `slot_bytes`. Chunks take consecutive ranges of the data area (a
    ring: many small chunks or a few large ones in flight, at most `window` (and `DESCRIPTORS`)
    and, beyond two, `window_bytes`), each free again once the receiver released it.
    `reserve(n)` hands out the next range so callers can pack straight into shared memory (no copy
    on send).

    `window_bytes` keeps the ring's working set in cache: with the whole segment in flight (256 MB
    by default) a sender ahead of its receiver walks all of it and every copy runs at DRAM speed,
    where a few MB still let it write the next chunk while the receiver checks the last one. A
    sender whose window is full sleeps until half of it is released (one wake-up per half window,
    not one per chunk)."""

    def __init__(self, address: str, slots: int = 4, slot_bytes: int = 64 << 20, timeout: float = 10.0, window: int = 64,
                 window_bytes: int = WINDOW_BYTES) -> None:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"slots and slot_bytes must be positive ({slots}, {slot_bytes})")
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self.address = address
        self._sockaddr = _sockaddr(address)
        data = slots * (slot_bytes + HEADER_ROOM)  # a chunk's range: its payload, then its header
        self.shm = shared_memory.SharedMemory(name=f"kvflow-{uuid.uuid4().hex[:16]}", create=True, size=_DATA_START + data)
        self.ring = _Ring(data)
        self.link = Window(address, max(window, slots), timeout, on_ack=self.ring.free, window_bytes=min(window_bytes, slots * slot_bytes))
        words = np.frombuffer(self.shm.buf, dtype=np.int64, count=_DATA_START // 8)
        self._ctl = words[:CONTROL_WORDS]
        self._desc = words[CONTROL_WORDS:].reshape(DESCRIPTORS, 8)
        self._state = self._desc[:, STATE]
        self._base = buffer_address(self.shm.buf) + _DATA_START
        self._bytes = np.frombuffer(self.shm.buf, dtype=np.uint8)[_DATA_START:]  # the data area, viewed once (~20 us a view)
        self._tensor = torch.from_numpy(self._bytes)
        self._reserved: list | None = None
        self._published = 0  # descriptors published (HEAD)
        self._released = 0  # RELEASED when last looked at
        self.sock: socket.socket | None = None  # connected on the first send

    # -------------------------------------------------------------- connection and wake-ups
    def _connect(self) -> socket.socket:
        if self.sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(self._sockaddr)
                s.send(self.shm.name.encode())  # the first message names the segment
            except OSError as e:
                s.close()
                raise PeerGone(f"no receiver at {self.address}: {e}") from None
            s.setblocking(False)  # waits are polls with the timeout
            self.sock = s
            self._poll = select.poll()
            self._poll.register(s, select.POLLIN)
        return self.sock

    def _gone(self, why: str) -> PeerGone:
        return PeerGone(f"receiver at {self.address} disconnected ({why}) with {len(self.link.inflight)} chunk(s) unacknowledged")

    def _take_acks(self) -> None:
        """Apply every release the receiver recorded since the last look (PeerRejected if one was a rejection)."""
        released = int(self._ctl[RELEASED])
        if released == self._released:
            return
        new, self._released = released - self._released, released
        acks, state = [], self._state
        for tag in self.link.inflight:  # oldest first: in the usual case the first `new` are the released ones
            i = tag % DESCRIPTORS
            if state[i] != PENDING:
                err = None
                if state[i] == REJECTED:
                    off, elen = int(self._desc[i, HEAD_OFF]), int(self._desc[i, ERR_LEN])
                    err = bytes(self._bytes[off : off + elen]).decode(errors="replace") or "rejected"
                state[i] = PENDING
                acks.append((tag, err))
                if len(acks) == new:
                    break
        self.link._acked(acks)

    def _wait_released(self, target: int) -> None:
        """Sleep until RELEASED reaches `target` (woken by the receiver); PeerTimeout when nothing
        is released for `timeout` seconds, PeerGone when the receiver goes away."""
        sock, ctl = self._connect(), self._ctl
        last, deadline = int(ctl[RELEASED]), time.monotonic() + self.timeout
        if _spin(lambda: ctl[RELEASED] >= target):
            return
        while True:
            ctl[TX_WAKE_AT] = target
            _fence()
            now = int(ctl[RELEASED])
            if now >= target:
                ctl[TX_WAKE_AT] = 0
                return
            if now != last:
                last, deadline = now, time.monotonic() + self.timeout
            left = deadline - time.monotonic()
            if left <= 0:
                ctl[TX_WAKE_AT] = 0
                raise PeerTimeout(f"receiver at {self.address} acknowledged nothing for {self.timeout}s")
            if self._poll.poll(left * 1000):
                try:
                    while sock.recv(64, socket.MSG_DONTWAIT):  # wake-up bytes
                        pass
                    raise self._gone("end of stream")
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise self._gone(str(e)) from None

    def _make_room(self) -> None:
        """Wait for half of what is in flight (at least one chunk) to be released, then apply it."""
        self._wait_released(self._released + max(1, (self._published - self._released) // 2))
        self._take_acks()

    def _alloc(self, nbytes: int) -> list:
        while (r := self.ring.alloc(nbytes)) is None:
            self._make_room()
        return r

    # -------------------------------------------------------------- the contract
    def reserve(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self.slot_bytes:
            return None
        if self._reserved is not None and self._reserved[1] - self._reserved[0] < nbytes + HEADER_ROOM:
            self.ring.free(self._reserved)
            self._reserved = None
        if self._reserved is None:
            self._take_acks()
            self._reserved = self._alloc(nbytes + HEADER_ROOM)
        return self._tensor[self._reserved[0] : self._reserved[0] + nbytes]

    def _full(self, nbytes: int) -> bool:
        link = self.link
        return link._full(nbytes) or (link.inflight and link._next_tag - next(iter(link.inflight)) >= DESCRIPTORS)

    def send(self, header: bytes, payload: memoryview) -> None:
        self.send_many([(header, payload)])

    def send_many(self, frames: list[tuple[bytes, memoryview]]) -> None:
        """Places each chunk, then publishes them together (one store of HEAD, one fence, at most
        one wake-up); what is placed is published before any wait for room."""
        self._connect()
        self._take_acks()
        try:
            for header, payload in frames:
                self._put(header, payload)
        finally:
            self._publish()

    def _put(self, header: bytes, payload: memoryview) -> None:
        n = payload.nbytes
        if n > self.slot_bytes:
            raise ChunkOversized(f"payload of {n} bytes exceeds the shared-memory slot size {self.slot_bytes}")
        hoff = -(-n // ALIGN) * ALIGN  # the header goes after the payload, in the same range
        room = hoff + max(len(header), ERROR_ROOM)
        if room > self.ring.size:
            raise ChunkOversized(f"a {len(header)}-byte header with a {n}-byte payload does not fit the {self.ring.size}-byte segment")
        if self._full(n):
            self._publish()  # the receiver can only release what it sees
            while self._full(n):
                self._make_room()
        r, self._reserved = self._reserved, None
        if r is not None and (r[1] - r[0] < room or buffer_address(payload) != self._base + r[0]):
            self.ring.free(r)  # not packed there after all, or no room for this header: copied (numpy copies overlaps right)
            r = None
        if r is None:
            r = self.ring.alloc(room)
            if r is None:
                self._publish()
                r = self._alloc(room)
            if n:
                self._bytes[r[0] : r[0] + n] = np.frombuffer(payload, dtype=np.uint8)
        hoff += r[0]
        self._bytes[hoff : hoff + len(header)] = np.frombuffer(header, dtype=np.uint8)
        tag = self.link._open(r, r[1] - r[0]) & ~URGENT
        self._desc[tag % DESCRIPTORS] = (tag, r[0], n, hoff, len(header), PENDING, 0, 0)

    def _publish(self) -> None:
        """Make every placed chunk visible (HEAD, after their payloads, headers and descriptors:
        x86 keeps stores in order) and wake the receiver if it sleeps."""
        placed = self.link._next_tag
        if placed == self._published:
            return
        self._published = placed
        self._ctl[HEAD] = placed
        _fence()
        if self._ctl[RX_SLEEPING]:
            self._ctl[RX_SLEEPING] = 0
            try:
                self.sock.send(b"w")
            except BlockingIOError:  # wake-ups already queued: it will wake
                pass
            except OSError as e:
                raise self._gone(str(e)) from None

    def drain(self) -> None:
        self._take_acks()
        while self.link.inflight:
            self._wait_released(self._published)
            self._take_acks()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.shm.unlink()
        self._bytes = self._tensor = self._ctl = self._desc = self._state = None
        try:
            self.shm.close()
        except BufferError:  # a reserved view is still referenced; the mapping goes with the process
            pass


class _Peer:
    """The receiver's view of one connected sender: its socket, and its segment once named."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seg: mmap.mmap | None = None
        self.tail = 0  # descriptors taken
        self.closing = False  # its socket ended: dropped once its published chunks are taken
        self.alive = True

    def attach(self, name: str) -> None:
        # Mapped directly rather than through SharedMemory: attaching that way registers the segment
        # with the resource tracker (shared with the sender when spawned), which then unlinks or
        # double-unregisters it. The sender owns and unlinks the segment.
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.seg = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        words = np.frombuffer(self.seg, dtype=np.int64, count=_DATA_START // 8)
        self.ctl = words[:CONTROL_WORDS]
        self.desc = words[CONTROL_WORDS:].reshape(DESCRIPTORS, 8)
        self.data = memoryview(self.seg)[_DATA_START:]
        self.bytes = np.frombuffer(self.seg, dtype=np.uint8)[_DATA_START:]

    def ready(self) -> bool:
        return self.seg is not None and self.ctl[HEAD] > self.tail


class ShmReceiver(ChunkReceiver):
    """Listens on a fresh abstract Unix address (`address`); any number of senders connect, each
    with its own segment. Polls the senders' descriptor rings in turn and blocks on their sockets
    only when all are empty."""

    POLL_EVERY = 32  # chunks taken between looks for new senders and closed ones while busy

    def __init__(self) -> None:
        self.address = f"{_PREFIX}kvflow-{uuid.uuid4().hex}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(_sockaddr(self.address))
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
            _fence()
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
        """Poll the rings a while (`_spin`) when the last chunk came within `SPIN_S`: a busy stream."""
        left = self._last_take + SPIN_S - time.monotonic()
        return left > 0 and _spin(lambda: any(p.ready() for p in self.order), left)

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
                _fence()
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

"""Shared-memory transport (same host), and its sending side: a chunk's payload and header sit in a
per-sender segment, and so do the descriptors that announce them and the acknowledgements that free
them; a Unix socket beside it carries only the segment's name and wake-ups.

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

`ShmSender` is here; `ShmReceiver` in `shm_receiver`, the segment's layout and the primitives both
sides share in `shm_segment`.
"""

from __future__ import annotations

import select
import socket
import time
import uuid
from multiprocessing import shared_memory

import numpy as np
import torch

from kvflow.streaming.errors import ChunkOversized, PeerGone, PeerTimeout
from kvflow.streaming.transport import ChunkSender, buffer_address
from kvflow.streaming.transports.link import URGENT, Window
from kvflow.streaming.transports.shm_segment import (
    ALIGN,
    DATA_START,
    DESCRIPTORS,
    ERR_LEN,
    ERROR_ROOM,
    HEAD,
    HEAD_OFF,
    PENDING,
    REJECTED,
    RELEASED,
    RX_SLEEPING,
    STATE,
    TX_WAKE_AT,
    Ring,
    control_views,
    fence,
    sockaddr,
    spin,
)

WINDOW_BYTES = 4 << 20  # payload bytes in flight beyond two chunks (see ShmSender)
HEADER_ROOM = 4096  # bytes `reserve()` keeps after the payload for the chunk's header


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
        self._sockaddr = sockaddr(address)
        data = slots * (slot_bytes + HEADER_ROOM)  # a chunk's range: its payload, then its header
        self.shm = shared_memory.SharedMemory(name=f"kvflow-{uuid.uuid4().hex[:16]}", create=True, size=DATA_START + data)
        self.ring = Ring(data)
        self.link = Window(address, max(window, slots), timeout, on_ack=self.ring.free, window_bytes=min(window_bytes, slots * slot_bytes))
        self._ctl, self._desc = control_views(self.shm.buf)
        self._state = self._desc[:, STATE]
        self._base = buffer_address(self.shm.buf) + DATA_START
        self._bytes = np.frombuffer(self.shm.buf, dtype=np.uint8)[DATA_START:]  # the data area, viewed once (a view is not free)
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
        if spin(lambda: ctl[RELEASED] >= target):
            return
        while True:
            ctl[TX_WAKE_AT] = target
            fence()
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
        fence()
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

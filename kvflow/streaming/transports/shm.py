"""Shared-memory transport (same host): payloads sit in a per-sender segment, only (where, header)
crosses the control link (a Unix socket, see `unix_link`) as one small message, and the receiver
reads the payload in place."""

from __future__ import annotations

import mmap
import os
import struct
import uuid
from collections import deque
from multiprocessing import shared_memory

import _posixshmem
import numpy as np
import torch

from kvflow.streaming.errors import ChunkOversized
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk, buffer_address
from kvflow.streaming.transports.unix_link import UnixLinkReceiver, UnixLinkSender

ALIGN = 64
WINDOW_BYTES = 4 << 20  # payload bytes in flight beyond two chunks (see ShmSender)
_WHERE = struct.Struct("<QQB")  # offset, nbytes, length of the segment name that follows; then the chunk header


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
    """Owns a segment of `slots` x `slot_bytes` (named uniquely per instance, unlinked on close);
    a chunk is at most `slot_bytes`. Chunks take consecutive ranges of the segment (a ring: many
    small chunks or a few large ones in flight, at most `window` and, beyond two, `window_bytes`),
    each free again once the receiver acknowledged it. `reserve(n)` hands out the next range so
    callers can pack straight into shared memory (no copy on send).

    `window_bytes` keeps the ring's working set in cache: with the whole segment in flight (256 MB
    by default) a sender ahead of its receiver walks all of it and every copy runs at DRAM speed,
    where a few MB still let it write the next chunk while the receiver checks the last one."""

    def __init__(self, address: str, slots: int = 4, slot_bytes: int = 64 << 20, timeout: float = 10.0, window: int = 64,
                 window_bytes: int = WINDOW_BYTES) -> None:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"slots and slot_bytes must be positive ({slots}, {slot_bytes})")
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self.shm = shared_memory.SharedMemory(name=f"kvflow-{uuid.uuid4().hex[:16]}", create=True, size=slots * slot_bytes)
        self.ring = _Ring(slots * slot_bytes)
        self.link = UnixLinkSender(address, max(window, slots), timeout, on_ack=self.ring.free, window_bytes=min(window_bytes, slots * slot_bytes))
        self._reserved: list | None = None
        self._name = self.shm.name.encode()
        self._base = buffer_address(self.shm.buf)
        self._bytes = np.frombuffer(self.shm.buf, dtype=np.uint8)  # the segment, viewed once (a view per chunk costs ~20 us)
        self._tensor = torch.from_numpy(self._bytes)

    def _take(self, nbytes: int) -> list:
        while (r := self.ring.alloc(nbytes)) is None:
            self.link._wait_one_ack()
        return r

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self.slot_bytes:
            return None
        if self._reserved is not None and self._reserved[1] - self._reserved[0] < nbytes:
            self.ring.free(self._reserved)
            self._reserved = None
        if self._reserved is None:
            self._reserved = self._take(max(nbytes, 1))
        return self._tensor[self._reserved[0] : self._reserved[0] + nbytes]

    def send(self, header: bytes, payload: memoryview) -> None:
        n = payload.nbytes
        if n > self.slot_bytes:
            raise ChunkOversized(f"payload of {n} bytes exceeds the shared-memory slot size {self.slot_bytes}")
        r, self._reserved = self._reserved, None
        if r is not None and r[1] - r[0] < n:
            self.ring.free(r)
            r = None
        if r is None:
            r = self._take(max(n, 1))
        if n and buffer_address(payload) != self._base + r[0]:
            self._bytes[r[0] : r[0] + n] = np.frombuffer(payload, dtype=np.uint8)
        try:
            self.link.send(_WHERE.pack(r[0], n, len(self._name)) + self._name + header, token=r, nbytes=r[1] - r[0])
        except BaseException:
            self.ring.free(r)
            raise

    def drain(self) -> None:
        self.link.drain()

    def close(self) -> None:
        self.link.close()
        self.shm.unlink()
        self._bytes = self._tensor = None
        try:
            self.shm.close()
        except BufferError:  # a reserved view is still referenced; the mapping goes with the process
            pass


class ShmReceiver(ChunkReceiver):
    """Listens on a fresh control address; attaches to each sender's segment on its first chunk."""

    def __init__(self) -> None:
        self.link = UnixLinkReceiver()
        self.segments: dict[str, mmap.mmap] = {}

    @property
    def address(self) -> str:
        return self.link.address

    def _segment(self, name: str) -> mmap.mmap:
        # Mapped directly rather than through SharedMemory: attaching that way registers the segment
        # with the resource tracker (shared with the sender when spawned), which then unlinks or
        # double-unregisters it. The sender owns and unlinks the segment.
        if name not in self.segments:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            try:
                self.segments[name] = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        return self.segments[name]

    def recv(self, timeout: float | None = None) -> RawChunk:
        ident, tag, head, frames = self.link.recv(timeout)
        try:
            if frames:
                raise ValueError(f"{len(frames)} unexpected payload frame(s)")
            offset, n, name_len = _WHERE.unpack_from(head)
            name = bytes(head[_WHERE.size : _WHERE.size + name_len]).decode()
            header = bytes(head[_WHERE.size + name_len :])
            seg = self._segment(name)
            if offset < 0 or offset + n > len(seg):
                raise ValueError(f"slot [{offset}, {offset + n}) outside segment of {len(seg)} bytes")
        except Exception as e:
            self.link.ack(ident, tag, f"bad shared-memory message: {e}")
            return RawChunk(b"", memoryview(b""))
        view = memoryview(seg)[offset : offset + n]

        def release(err: str | None) -> None:
            self.link.ack(ident, tag, err)
            try:
                view.release()
            except BufferError:  # the caller still holds a tensor over the slot
                pass

        return RawChunk(header, view, release)

    def close(self) -> None:
        self.link.close()
        for seg in self.segments.values():
            try:
                seg.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the process
                pass

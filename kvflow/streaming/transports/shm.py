"""Shared-memory transport (same host): payloads sit in slots of a per-sender segment, only
(header, slot) crosses the ZeroMQ control link, and the receiver reads the slot in place."""

from __future__ import annotations

import os
import uuid
import mmap
from multiprocessing import shared_memory

import _posixshmem

import msgpack
import numpy as np
import torch

from kvflow.streaming.errors import ChunkOversized
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk
from kvflow.streaming.transports.zmq_link import LinkReceiver, LinkSender


class ShmSender(ChunkSender):
    """Owns a segment of `slots` x `slot_bytes` (named uniquely per instance, unlinked on close).
    A slot is free again once the receiver acknowledges the chunk in it. `reserve(n)` hands out the
    next free slot so callers can pack straight into shared memory (no copy on send)."""

    def __init__(self, address: str, slots: int = 4, slot_bytes: int = 64 << 20, timeout: float = 10.0) -> None:
        if slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"slots and slot_bytes must be positive ({slots}, {slot_bytes})")
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self.shm = shared_memory.SharedMemory(name=f"kvflow-{uuid.uuid4().hex[:16]}", create=True, size=slots * slot_bytes)
        self.free = list(range(slots))
        self.link = LinkSender(address, slots, timeout, on_ack=self.free.append)
        self._reserved: int | None = None

    def _slot_view(self, slot: int, nbytes: int) -> memoryview:
        return self.shm.buf[slot * self.slot_bytes : slot * self.slot_bytes + nbytes]

    def _take_slot(self) -> int:
        while not self.free:
            self.link._wait_one_ack()
        return self.free.pop(0)

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self.slot_bytes:
            return None
        if self._reserved is None:
            self._reserved = self._take_slot()
        return torch.frombuffer(self._slot_view(self._reserved, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]

    def send(self, header: bytes, payload: memoryview) -> None:
        n = payload.nbytes
        if n > self.slot_bytes:
            raise ChunkOversized(f"payload of {n} bytes exceeds the shared-memory slot size {self.slot_bytes}")
        slot = self._reserved if self._reserved is not None else self._take_slot()
        self._reserved = None
        view = self._slot_view(slot, n)
        if n and _address(view) != _address(payload):
            view[:] = payload
        try:
            self.link.send([header, msgpack.packb([self.shm.name, slot * self.slot_bytes, n])], token=slot)
        except Exception:
            self.free.append(slot)
            raise

    def drain(self) -> None:
        self.link.drain()

    def close(self) -> None:
        self.link.close()
        self.shm.unlink()
        try:
            self.shm.close()
        except BufferError:  # a reserved view is still referenced; the mapping goes with the process
            pass


def _address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


class ShmReceiver(ChunkReceiver):
    """Binds a control socket on a free port; attaches to each sender's segment on its first chunk."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.link = LinkReceiver(host, port)
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
        ident, tag, frames = self.link.recv(timeout)
        try:
            header, where = frames
            name, offset, n = msgpack.unpackb(where.bytes)
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

        return RawChunk(header.bytes, view, release)

    def close(self) -> None:
        self.link.close()
        for seg in self.segments.values():
            try:
                seg.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the process
                pass

"""File-store transport (local disk / SSD): one file per chunk, written atomically, read memory-mapped."""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

from kvflow.streaming.errors import ChunkTruncated
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk

MAGIC = b"KVC1"
_PREFIX = struct.Struct("<4sI")  # magic, header length
SUFFIX = ".kvc"


def chunk_path(root: Path, index: int) -> Path:
    return root / f"{index:012d}{SUFFIX}"


def _existing(root: Path) -> list[int]:
    return sorted(int(p.stem) for p in root.glob(f"*{SUFFIX}") if p.stem.isdigit())


class FileSender(ChunkSender):
    """Appends chunk files 000000000000.kvc, 000000000001.kvc, ... to `root` (one writer per
    directory; reopening continues after the last file). A file appears under its final name only
    once complete (write to a temp name, then rename). `fsync=True` makes `drain` durable."""

    def __init__(self, root: str | os.PathLike, fsync: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._dir = str(self.root)
        self.fsync = fsync
        existing = _existing(self.root)
        self.next_index = existing[-1] + 1 if existing else 0
        self.timeout = 0.0
        self._unsynced: list[str] = []

    def send(self, header: bytes, payload: memoryview) -> None:
        self.send_at(self.next_index, header, payload)
        self.next_index += 1

    def send_at(self, index: int, header: bytes, payload: memoryview) -> int:
        """Write (or replace) chunk file `index` atomically; returns the file's size in bytes. The
        KV tiers' disk store addresses its slots this way (`read_chunk_file(chunk_path(root, i))`)."""
        final = os.path.join(self._dir, f"{index:012d}{SUFFIX}")
        tmp = final[: -len(SUFFIX)] + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        parts = frame(header, payload)
        try:
            _write_all(fd, parts)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        if self.fsync:
            self._unsynced.append(final)
        return len(parts[0]) + memoryview(payload).nbytes

    def drain(self) -> None:
        if self.fsync:
            for p in self._unsynced:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._unsynced.clear()

    def close(self) -> None:
        self.drain()


def _write_all(fd: int, parts: list) -> None:
    """One writev for the whole chunk file (a write may stop short: carry on from where it did)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        done = os.writev(fd, views)
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if views:
            views[0] = views[0][done:]


class FileReceiver(ChunkReceiver):
    """Reads a store's chunk files in order from `start` (a fresh receiver re-reads from 0, so a
    store can be reopened after a restart). Payloads are memory-mapped views; `release()` unmaps."""

    def __init__(self, root: str | os.PathLike, start: int = 0, poll_interval: float = 0.002) -> None:
        self.root = Path(root)
        self.next_index = start
        self.poll_interval = poll_interval

    def __len__(self) -> int:
        """Chunk files currently in the store."""
        return len(_existing(self.root)) if self.root.exists() else 0

    def recv(self, timeout: float | None = None) -> RawChunk:
        path = chunk_path(self.root, self.next_index)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not path.exists():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no chunk {path.name} in {self.root} within {timeout}s")
            time.sleep(self.poll_interval)
        self.next_index += 1
        return read_chunk_file(path)

    def close(self) -> None:
        pass


def frame(header: bytes, payload) -> list:
    """A chunk as one byte string in two parts (prefix with the header, then the payload): a chunk file's
    content, and the body of a KV pull's answer (`kvflow.streaming.kv_pull`)."""
    return [_PREFIX.pack(MAGIC, len(header)) + header, payload]


def _split(buf, size: int, what: str) -> tuple[bytes, memoryview]:
    if size < _PREFIX.size:
        raise ChunkTruncated(f"{what} is {size} bytes, shorter than a chunk prefix")
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or _PREFIX.size + hlen > size:
        raise ChunkTruncated(f"{what} is not a complete chunk (magic {magic!r}, header {hlen} bytes, {size} in all)")
    return buf[_PREFIX.size : _PREFIX.size + hlen], memoryview(buf)[_PREFIX.size + hlen :]


def parse_frame(buf: bytes, what: str) -> RawChunk:
    """A chunk from the bytes `frame` made (not yet verified)."""
    header, payload = _split(buf, len(buf), what)
    return RawChunk(bytes(header), payload)


def read_chunk_file(path: Path) -> RawChunk:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREFIX.size:
            raise ChunkTruncated(f"{path} is {size} bytes, shorter than a chunk prefix")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header, payload = _split(mm, size, str(path))
    except ChunkTruncated:
        mm.close()
        raise

    def unmap(_error: str | None) -> None:
        try:
            payload.release()
            mm.close()
        except BufferError:  # a tensor view still points into the map; it is unmapped when collected
            pass

    return RawChunk(header, payload, unmap)

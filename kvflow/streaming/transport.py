"""The transport interface: move (header bytes, payload bytes) frames one way, with acknowledgements."""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RawChunk:
    """One received frame pair, not yet validated. `payload` may point into transport memory
    (a ZeroMQ frame, a shared-memory slot, a memory-mapped file): copy out of it, then `release()`.
    `release(error)` acknowledges the chunk to the sender; a non-None error tells it the chunk was rejected."""

    header: bytes
    payload: memoryview
    _release: Callable[[str | None], None] | None = field(default=None, repr=False)

    def release(self, error: str | None = None) -> None:
        if self._release is not None:
            fn, self._release = self._release, None
            fn(error)


class _Endpoint(ABC):
    """Either end of a channel: closing releases its sockets / memory; usable as a context manager."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChunkSender(_Endpoint):
    """The sending end of one channel.

    Contract:
    - `send(header, payload)` hands one chunk to the destination. When it returns, `payload` may be
      reused by the caller. It raises `PeerGone` / `PeerTimeout` (never blocks forever) when the
      destination disconnected or has not acknowledged earlier chunks within `timeout` seconds, and
      `PeerRejected` when the destination reported that an earlier chunk was rejected.
    - `drain()` returns once every chunk sent so far is acknowledged (consumed) by the destination,
      with the same errors.
    - `reserve(nbytes)` may return a uint8 host tensor living in transport memory (zero-copy
      staging): a payload packed there and passed to `send` is not copied again. None means "use
      your own buffer".
    - `send_many([(header, payload), ...])` is `send` of each in order, with the per-message work
      (system calls, publishing, acknowledgement reads) shared where the transport can. If it
      raises, which of them went out is not known: the stream is to be abandoned.
    """

    timeout: float

    @abstractmethod
    def send(self, header: bytes, payload: memoryview) -> None: ...

    def send_many(self, frames: list[tuple[bytes, memoryview]]) -> None:
        for header, payload in frames:
            self.send(header, payload)

    @abstractmethod
    def drain(self) -> None: ...

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        return None


class ChunkReceiver(_Endpoint):
    """The receiving end of one channel (possibly fed by several senders).

    Contract: `recv(timeout)` returns the next `RawChunk` in arrival order (per sender, in send
    order), or raises `TimeoutError` after `timeout` seconds (None = wait forever). The caller must
    `release()` every chunk it got; that is the acknowledgement flow control waits for.
    `recv_many(max_chunks, timeout)` waits like `recv` for the first chunk, then adds those that
    are already there (at most `max_chunks` in all), without waiting for more.
    `check_headers(authentic)` (called by an `InStream` holding a secret, before the first `recv`)
    lets a receiver refuse a chunk whose header frame is not `authentic(header)` before it buffers
    the payload; one that cannot tell ignores it (`fetch` verifies every header anyway).
    """

    @abstractmethod
    def recv(self, timeout: float | None = None) -> RawChunk: ...

    def check_headers(self, authentic: Callable[[bytes], bool]) -> None:
        pass

    def recv_many(self, max_chunks: int, timeout: float | None = None) -> list[RawChunk]:
        got = [self.recv(timeout)]
        while len(got) < max_chunks:
            try:
                got.append(self.recv(0))
            except TimeoutError:
                break
        return got


def buffer_address(buf) -> int:
    """The address of a buffer's first byte (to tell whether a payload already sits in transport memory)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # cheap; writable buffers of a byte or more
    except (TypeError, ValueError):
        return np.frombuffer(buf, dtype=np.uint8).ctypes.data

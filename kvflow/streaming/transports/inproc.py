"""In-process channel: a bounded queue between two threads (for tests and single-process pipelines)."""

from __future__ import annotations

import queue
import threading

from kvflow.streaming.errors import PeerGone, PeerRejected, PeerTimeout
from kvflow.streaming.transport import ChunkReceiver, ChunkSender, RawChunk


class InprocChannel:
    """A sender/receiver pair sharing one queue. Payloads are copied on send (the caller reuses its buffer)."""

    def __init__(self, window: int = 64, timeout: float = 10.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self._q: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._credits = threading.Semaphore(window)
        self._window = window
        self._errors: list[str] = []
        self.closed = False
        self.sender = _InprocSender(self, timeout)
        self.receiver = _InprocReceiver(self)


class _InprocSender(ChunkSender):
    def __init__(self, ch: InprocChannel, timeout: float) -> None:
        self.ch = ch
        self.timeout = timeout

    def _check(self) -> None:
        if self.ch._errors:
            raise PeerRejected(self.ch._errors.pop(0))
        if self.ch.closed:
            raise PeerGone("in-process receiver is closed")

    def send(self, header: bytes, payload: memoryview) -> None:
        self._check()
        if not self.ch._credits.acquire(timeout=self.timeout):
            raise PeerTimeout(f"in-process receiver consumed nothing for {self.timeout}s")
        self._check()
        self.ch._q.put((bytes(header), bytes(payload)))

    def drain(self) -> None:
        got = 0
        try:
            for _ in range(self.ch._window):
                if not self.ch._credits.acquire(timeout=self.timeout):
                    self._check()
                    raise PeerTimeout(f"in-process receiver did not consume its chunks within {self.timeout}s")
                got += 1
        finally:
            for _ in range(got):
                self.ch._credits.release()
        self._check()

    def close(self) -> None:
        pass


class _InprocReceiver(ChunkReceiver):
    def __init__(self, ch: InprocChannel) -> None:
        self.ch = ch

    def recv(self, timeout: float | None = None) -> RawChunk:
        try:
            header, payload = self.ch._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no chunk within {timeout}s") from None
        return RawChunk(header, memoryview(payload), self._ack)

    def _ack(self, error: str | None) -> None:
        if error is not None:
            self.ch._errors.append(error)
        self.ch._credits.release()

    def close(self) -> None:
        self.ch.closed = True

"""What the transports' links share: tagged messages and the sender's window of unacknowledged
ones (TCP and shared memory), and acknowledgements coalesced by the receiver (TCP; shared memory
records each release in its segment, where acknowledging costs a store, not a message).

Every message carries a 64-bit tag. The receiver acknowledges each tag (with an error string when it
rejected the message); acknowledgements are held back while more messages are already waiting
(`ack_batch` at most), and sent at once when the receiver runs dry, rejects one, or the sender marked
the message URGENT (its window is full: it waits for an ack to send more). On a busy host each
message that wakes a peer costs tens of microseconds; a link sets its own batch (`ack_batch`).
"""

from __future__ import annotations

import struct
from typing import Any

from kvflow.streaming.errors import PeerRejected

_TAG = struct.Struct("<Q")
URGENT = 1 << 63  # tag bit: acknowledge this message at once
ACK_BATCH = 8  # the most acknowledgements a receiver holds back while it has messages queued (default)


class Window:
    """The sender's bookkeeping: at most `window` messages and (beyond the first two)
    `window_bytes` payload bytes unacknowledged; `on_ack(token)` runs for each acknowledged one."""

    def __init__(self, address: str, window: int, timeout: float, on_ack=None, window_bytes: int | None = None) -> None:
        if window <= 0 or timeout <= 0 or (window_bytes is not None and window_bytes <= 0):
            raise ValueError(f"window, window_bytes and timeout must be positive ({window}, {window_bytes}, {timeout})")
        self.address = address
        self.window = window
        self.window_bytes = window_bytes or 1 << 62
        self.timeout = timeout
        self.on_ack = on_ack
        self.inflight: dict[int, tuple[Any, int]] = {}  # tag -> (token, payload bytes)
        self.inflight_bytes = 0
        self._next_tag = 0

    def _full(self, nbytes: int) -> bool:
        n = len(self.inflight)
        return n >= self.window or (n >= 2 and self.inflight_bytes + nbytes > self.window_bytes)

    def _open(self, token: Any, nbytes: int) -> int:
        """The tag of the next message (URGENT when the one after it, of this size, would wait for
        acks), counted as in flight."""
        tag = self._next_tag
        self._next_tag += 1
        n = len(self.inflight) + 1
        self.inflight[tag] = (token, nbytes)
        self.inflight_bytes += nbytes
        return tag | URGENT if n >= self.window or (n >= 2 and self.inflight_bytes + nbytes > self.window_bytes) else tag

    def _forget(self, tag: int) -> None:
        """A message that could not be sent after all: no longer in flight (its token not acked)."""
        _, nbytes = self.inflight.pop(tag & ~URGENT)
        self.inflight_bytes -= nbytes

    def _acked(self, acks) -> None:
        """Apply (tag, error) pairs; PeerRejected once all are applied if any carried an error."""
        error = None
        for tag, err in acks:
            if tag not in self.inflight:
                continue  # not ours (a confused receiver): nothing to free
            token, nbytes = self.inflight.pop(tag)
            self.inflight_bytes -= nbytes
            if self.on_ack is not None:
                self.on_ack(token)
            error = error or err
        if error is not None:
            raise PeerRejected(f"receiver at {self.address} rejected a chunk: {error}")


class CoalescedAcks:
    """The receiver's side of the acknowledgement protocol (module docstring), for any link:
    acknowledgements per sender are held back while more messages wait, up to `ack_batch`, and sent
    at once on a rejection, an URGENT tag or when the receiver runs dry. A link provides
    `_known(ident)`, `_has_input(ident)` and `_send_ack_batch(ident, [(tag, error), ...])`."""

    ack_batch = ACK_BATCH

    def __init__(self) -> None:
        self._acks: dict = {}

    def _known(self, ident) -> bool:
        return True

    def _has_input(self, ident) -> bool:
        raise NotImplementedError

    def _send_ack_batch(self, ident, acks: list[tuple[int, str | None]]) -> None:
        raise NotImplementedError

    def ack(self, ident, tag: int, error: str | None) -> None:
        """Acknowledge (error None) or reject a message (tag as received)."""
        if tag < 0 or not self._known(ident):
            return
        pending = self._acks.setdefault(ident, [])
        pending.append((tag & ~URGENT, error))
        if error is not None or tag & URGENT or len(pending) >= self.ack_batch or not self._has_input(ident):
            self._send_acks(ident)

    def _send_acks(self, ident) -> None:
        pending = self._acks.pop(ident, None)
        if pending:
            self._send_ack_batch(ident, pending)

    def flush_acks(self) -> None:
        for ident in list(self._acks):
            self._send_acks(ident)

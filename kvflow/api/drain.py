"""Graceful shutdown of the API: stop admitting, let in-flight requests finish up to a drain timeout, then
cancel the rest with a clear error.

The server calls `Drain.run()` once it has stopped accepting connections. Requests register with
`enter()`/`leave()`; while running they race their backend against `expired` (see
`kvflow.api.generation`), so when the timeout passes each one ends itself: a whole answer becomes a 503
`server_shutdown` error, a stream gets an `{"error": ...}` event and `data: [DONE]`. `cut()` (a second
SIGTERM / Ctrl-C) makes the timeout pass at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from kvflow.api.errors import APIError, unavailable

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 5.0  # after the timeout: how long cancelled requests get to send their error


class Drain:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"the drain timeout must be >= 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0
        self.cut_short = False  # `cut()` ended the drain before its timeout
        self.expired = asyncio.Event()  # set when the drain timeout has passed: running requests must stop
        self.started = threading.Event()  # set when draining begins (observable from other threads)
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        """Raise the 503 a request arriving during shutdown gets (a kept-alive connection can still send one)."""
        if self.draining:
            raise unavailable("the server is shutting down and accepts no new requests", "server_shutting_down")

    def enter(self) -> None:
        self.admit()
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def shutdown_error(self) -> APIError:
        if self.cut_short:
            return unavailable("the server was stopped (a second shutdown signal ended the drain) before the request "
                               "finished; it was cancelled", "server_shutdown")
        return unavailable(f"the server shut down before the request finished (drain timeout {self.timeout_s:g} s); "
                           "it was cancelled", "server_shutdown")

    def cut(self) -> None:
        """End the drain now, on the event loop (a second signal): requests still running stop as at the timeout."""
        self.draining = True
        self.cut_short = True
        self.expired.set()

    async def run(self) -> None:
        """Stop admitting; wait for in-flight requests up to the timeout (or until `cut`); then make the rest stop
        and wait for them."""
        self.draining = True
        self.started.set()
        if self._idle.is_set():
            return
        if not self.expired.is_set():
            log.info("draining %d in-flight request(s) for up to %g s", self.in_flight, self.timeout_s)
            idle, cut = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self.expired.wait())
            try:
                await asyncio.wait({idle, cut}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()
                cut.cancel()
            if self._idle.is_set():
                return
        if not self.cut_short:
            log.warning("drain timeout (%g s) passed: cancelling %d request(s)", self.timeout_s, self.in_flight)
        self.expired.set()
        try:
            await asyncio.wait_for(self._idle.wait(), CANCEL_GRACE_S)
        except asyncio.TimeoutError:
            log.error("%d request(s) did not stop within %g s of being cancelled", self.in_flight, CANCEL_GRACE_S)

"""`SSEClient`: the router's HTTP/1.1 client for the one request it sends an instance — a POST of a JSON body answered
by a server-sent-event stream (or by a JSON error) — over keep-alive connections pooled per instance.

Why not `httpx`: a routed request's cost on the router is mostly its two HTTP hops, and `httpx`'s general client
(its connection pool's locks, request and response models, `aiter_lines`' decoding) cost more CPU per request than
the request itself needs; this client writes one request head and reads the chunked body's SSE payloads as bytes.

Contract of `SSEClient.events`: yields each event's `data:` payload (bytes) up to `[DONE]`, then reads the body to its
end and puts the connection back in the pool. Raises `HTTPStatus` when the answer is not 200 (its body as text) and
`HTTPFailed` when the connection fails (refused, reset, timed out, aborted by `abort_on`) or the body ends without
`[DONE]`. Closing the generator early closes its connection, which aborts the request on the instance. A pooled
connection the instance closed while idle is replaced once, before any byte of the answer was read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlparse

DONE = b"[DONE]"

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class HTTPFailed(Exception):
    """The connection failed or the answer broke off."""


class HTTPStatus(Exception):
    """The instance answered with a status other than 200 (`status`, the body's text)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class _Stale(Exception):
    """A pooled connection was closed by the instance before it answered: try a fresh one."""


class SSEClient:
    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    async def events(self, url: str, path: str, body: bytes, abort_on: asyncio.Event | None = None) -> AsyncIterator[bytes]:
        """The SSE payloads of `POST url+path` with the JSON `body` (see the module docstring); `abort_on`: an event
        whose setting breaks off the request (`HTTPFailed`), e.g. its instance taken out of the pool."""
        parsed = urlparse(url)
        key = (parsed.hostname or "127.0.0.1", parsed.port or (443 if parsed.scheme == "https" else 80))
        head = (f"POST {path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        conn = reused = None
        watch = None
        try:
            while True:
                if abort_on is not None and abort_on.is_set():
                    raise HTTPFailed("aborted")
                conn, reused = self._take(key), True
                if conn is None:
                    conn, reused = await self._open(key, parsed.scheme == "https"), False
                # watched from the request on: an instance that hangs before it answers is broken off too
                watch = _abort_when(abort_on, conn) if abort_on is not None else None
                try:
                    status, headers = await _send(conn, head, reused)
                    break
                except _Stale:
                    if watch is not None:
                        watch.cancel()
                    conn[1].transport.abort()
                    conn = None
            body_chunks = _body(conn[0], headers)
            if status != 200:
                text = b"".join([c async for c in body_chunks]).decode(errors="replace")
                raise HTTPStatus(status, text)
            buffer, done = b"", False
            async for data in body_chunks:
                if done:
                    continue  # (nothing follows [DONE] but the body's end)
                buffer += data
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end], buffer[end + 2:]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            if line[6:] == DONE:
                                done = True
                                break
                            yield line[6:]
                    if done:
                        break
            if not done:
                raise HTTPFailed("the stream ended without [DONE]")
            if headers.get(b"connection", b"").lower() != b"close":
                self._idle.setdefault(key, []).append(conn)
                conn = None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            if abort_on is not None and abort_on.is_set():
                raise HTTPFailed("aborted") from e
            raise HTTPFailed(f"{type(e).__name__}: {e}") from e
        finally:
            if watch is not None:
                watch.cancel()
            if conn is not None:  # not pooled: an error, an early close, or the instance's Connection: close
                conn[1].transport.abort()

    def _take(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn[0].at_eof() and not conn[1].is_closing():
                return conn
            conn[1].transport.abort()
        return None

    async def _open(self, key: tuple[str, int], tls: bool) -> Connection:
        try:
            return await asyncio.wait_for(asyncio.open_connection(*key, ssl=True if tls else None), self.connect_timeout_s)
        except asyncio.TimeoutError as e:
            raise HTTPFailed(f"no connection to {key[0]}:{key[1]} within {self.connect_timeout_s:g} s") from e

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.transport.abort()
        self._idle.clear()


def _abort_when(event: asyncio.Event, conn: Connection) -> asyncio.Future:
    """Abort `conn`'s transport once `event` is set (its reads then fail); cancel the result to stop watching."""
    transport = conn[1].transport
    watch = asyncio.ensure_future(event.wait())
    watch.add_done_callback(lambda t: t.cancelled() or transport.abort())
    return watch


async def _send(conn: Connection, request: bytes, reused: bool) -> tuple[int, dict[bytes, bytes]]:
    """Write the request and read the answer's status and headers (lower-cased names)."""
    reader, writer = conn
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        if reused and not getattr(e, "partial", b""):  # closed while idle: nothing of the answer was read
            raise _Stale from e
        raise
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
    """The answer's body as it arrives: chunked, of a given length, or up to the connection's end."""
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif b"content-length" in headers:
        n = int(headers[b"content-length"])
        if n:
            yield await reader.readexactly(n)
    else:
        while data := await reader.read(65536):
            yield data
        headers[b"connection"] = b"close"

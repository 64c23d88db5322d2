"""The ASGI middlewares in front of the routes, and the request body limit: `APIKeyAuth` (the API
key), `BodyLimit` (a body over the limit gets 413 before anything parses it), `StatusCounter`
(responses per route template and status, for /metrics) and `DirectRoutes` (the generation routes'
valid requests straight to their endpoints). `build_app` stacks them: the counter outermost, so it
counts the 401s and 413s; the key check before the body limit, so a stranger's body is never read;
the direct routes innermost, so they see only bodies within the limit.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from kvflow.api.errors import APIError, error_body
from kvflow.api.metrics import APIMetrics, endpoint_label

BODY_BYTES_PER_TOKEN = 32  # default body limit: this many bytes per context token (JSON escapes included) ...
MIN_BODY_BYTES = 1 << 20  # ... and never below 1 MiB
DISCARD_BYTES = 64 << 20  # a refused body announced up to this size is read and dropped, so the client sees the 413


def default_max_body_bytes(max_model_len: int) -> int:
    """The default request body limit: a few times what a prompt filling the context could take as JSON."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


class APIKeyAuth:
    """ASGI middleware: without `Authorization: Bearer <key>` every path but the open ones gets a 401 (OpenAI shape)."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided" if given else "Missing API key: send it as 'Authorization: Bearer <key>'")
        response = JSONResponse(error_body(message, "invalid_request_error", None, "invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class StatusCounter:
    """ASGI middleware counting responses per (route template or `other`, status) without touching the body
    stream. The label is never the raw path: a client can neither inject text into /metrics nor add series."""

    def __init__(self, app, metrics: APIMetrics, routes: list) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_response(endpoint_label(self.routes, scope), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


Endpoint = Callable[[BaseModel, Request], Awaitable[Response]]


class DirectRoutes:
    """ASGI middleware: a POST to one of `routes` (path -> body model, endpoint) whose body is JSON that validates
    against the model is answered by the endpoint at once — FastAPI's routing, dependency solving and middlewares
    cost more than a short request's own work on its first token's path. Anything else (another content type, a
    body that does not parse or validate) goes on to the app, which answers it with the same error as ever; an
    `APIError` from the endpoint becomes its response, as the app's handler makes it."""

    def __init__(self, app, routes: dict[str, tuple[type[BaseModel], Endpoint]]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _json_body(scope):
            return await self.app(scope, receive, send)
        message = await receive()  # (`BodyLimit` hands on the whole body as one message)
        try:
            if message["type"] != "http.request" or message.get("more_body", False):
                raise ValueError("not one whole body")
            body = route[0].model_validate(json.loads(message["body"]))
        except (ValueError, ValidationError):
            return await self.app(scope, _replay([message], receive), send)
        try:
            response = await route[1](body, Request(scope, receive))
        except APIError as e:
            response = e.response()
        await response(scope, receive, send)


def _json_body(scope) -> bool:
    """The request says its body is JSON, as `application/json` (what clients send; FastAPI takes other spellings
    too, and still does for the requests that do not come this way)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (`request_too_large`) before
    anything parses it — at once when Content-Length announces it, else as soon as the bytes read pass
    the limit. A body within the limit is read here and handed on whole; later `receive` calls (the
    disconnect a request watches for) go to the server. A refused body is read and dropped (up to
    `DISCARD_BYTES`), so that a client still sending it gets the 413 rather than a reset connection."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        announced = _content_length(scope)
        if announced is not None and announced > self.limit:
            if announced <= DISCARD_BYTES:
                await _discard(receive, announced)
            return await self._refuse(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                chunks.clear()
                if message.get("more_body", False):
                    await _discard(receive, DISCARD_BYTES - size)
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body is larger than this server's limit of {self.limit} bytes"
        response = JSONResponse(error_body(message, "invalid_request_error", None, "request_too_large"), status_code=413)
        await response(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _discard(receive, budget: int) -> None:
    """Read and drop body bytes until the body ends, the client leaves or `budget` bytes are read."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _replay(messages: list[dict], receive):
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()

    return replayed

"""Runs one prepared request through a `Backend`: a whole JSON answer or an SSE stream, aborted if the client leaves.

The backend validates before yielding, so the first output is awaited before any status is sent:
a ValueError then is a 400, `BackendUnavailable` a 503. A request the backend fails (finish_reason
"error") is a 500 error body, or, once streaming has started, an `{"error": ...}` event followed by
`data: [DONE]`. During shutdown, a request still running when the drain timeout passes ends the
same way with a 503 `server_shutdown` error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvflow.api.drain import Drain
from kvflow.api.errors import APIError, invalid_request, unavailable
from kvflow.api.metrics import APIMetrics
from kvflow.api.prepare import Prepared
from kvflow.api.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                 ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionChoiceWithIds,
                                 CompletionResponse, Usage)
from kvflow.sched.request import RequestOutput
from kvflow.serving.backend import Backend, BackendUnavailable

class ClientGone(Exception):
    """The client disconnected before the answer was ready; the backend request has been aborted."""


@dataclass
class Progress:
    """What one request has produced so far, timed by the API itself."""

    prompt_tokens: int
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    text: str = ""
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    closed: bool = False  # streamed request already aborted/accounted

    def add(self, out: RequestOutput, metrics: APIMetrics) -> None:
        if out.new_token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.tokens += len(out.new_token_ids)
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        metrics.tokens_sent(len(out.new_token_ids))
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error

    @property
    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.tokens)

    def record(self, metrics: APIMetrics, reason: str | None) -> None:
        ttft = None if self.first_token is None else self.first_token - self.start
        metrics.request_done(reason, self.prompt_tokens, self.tokens, ttft, time.monotonic() - self.start)


class ChunkFormat:
    """How one endpoint spells its answer: a whole response, stream chunks, the final usage chunk.
    `token_ids` (completions only): each choice carries its token ids too (`CompletionChoiceWithIds`)."""

    def __init__(self, chat: bool, request_id: str, model: str, token_ids: bool = False) -> None:
        self.chat, self.id, self.model, self.token_ids = chat, request_id, model, token_ids

    def response(self, p: Progress) -> BaseModel:
        if self.chat:
            choice = ChatChoice(message=AssistantMessage(content=p.text), finish_reason=p.finish_reason)
            return ChatCompletionResponse(id=self.id, model=self.model, choices=[choice], usage=p.usage)
        return CompletionResponse(id=self.id, model=self.model, usage=p.usage,
                                  choices=[self._choice(p.text, p.finish_reason, p.token_ids)])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(ChatDelta(role="assistant", content=""), None)] if self.chat else []

    def delta(self, text: str, finish_reason: str | None, token_ids: list[int]) -> BaseModel:
        if self.chat:
            return self._chunk(ChatDelta(content=text) if text else ChatDelta(), finish_reason)
        return CompletionResponse(id=self.id, model=self.model, choices=[self._choice(text, finish_reason, token_ids)])

    def _choice(self, text: str, finish_reason: str | None, token_ids: list[int]) -> CompletionChoice:
        if self.token_ids:
            return CompletionChoiceWithIds(text=text, finish_reason=finish_reason, token_ids=token_ids)
        return CompletionChoice(text=text, finish_reason=finish_reason)

    def usage(self, usage: Usage) -> BaseModel:
        if self.chat:
            return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage)

    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])


def _sse(obj: BaseModel | dict) -> bytes:
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n".encode()


def failed(p: Progress) -> APIError:
    return APIError(500, f"the request failed in the serving backend: {p.error or 'unknown error'}", "server_error",
                    None, "backend_error")


class Stopped(Exception):
    """The drain timeout passed during shutdown while the request was running; it has been aborted."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race(work: Awaitable, drain: Drain, request: Request | None = None):
    """Await `work`; if the client disconnects first (when `request` is given) raise ClientGone, if the drain
    timeout passes first raise Stopped. Either way `work` is cancelled and has finished before this returns,
    so the caller may close the generator it was iterating."""
    work = asyncio.ensure_future(work)
    watchers = {asyncio.ensure_future(drain.expired.wait()): Stopped}
    if request is not None:
        watchers[asyncio.ensure_future(_until_disconnect(request))] = ClientGone
    try:
        done, _ = await asyncio.wait({work, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise next(exc for w, exc in watchers.items() if w in done)()
    finally:
        for w in watchers:
            w.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)


async def start(backend: Backend, prepared: Prepared, request_id: str, request: Request,
                drain: Drain) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    """Submit and wait for the first output. A ValueError from the backend is the client's fault (400, naming
    the field it is about); `BackendUnavailable` is a 503."""
    agen = backend.generate(prepared.prompt_token_ids, prepared.params, request_id, prepared.kv_source)
    try:
        first = await race(anext(agen), drain, request)
    except ValueError as e:
        await agen.aclose()
        raise invalid_request(e, prepared.prompt_param, prepared.max_tokens_param) from e
    except BackendUnavailable as e:
        await agen.aclose()
        raise unavailable(f"the serving backend cannot take requests now: {e}; try again later") from e
    except BaseException:
        await agen.aclose()
        raise
    return agen, first


async def whole(agen: AsyncIterator[RequestOutput], first: RequestOutput, p: Progress, metrics: APIMetrics,
                request: Request, drain: Drain) -> None:
    """Collect every output into `p` (non-streaming answer)."""

    async def collect() -> None:
        p.add(first, metrics)
        if not first.finished:
            async for out in agen:
                p.add(out, metrics)

    try:
        await race(collect(), drain, request)
    finally:
        await agen.aclose()


async def stream(agen: AsyncIterator[RequestOutput], first: RequestOutput, p: Progress, fmt: ChunkFormat,
                 include_usage: bool, metrics: APIMetrics, drain: Drain) -> AsyncIterator[bytes]:
    """SSE bytes; cancellation (client gone) closes `agen`, which aborts the backend request. If the drain
    timeout passes during shutdown the stream ends with an error event and `data: [DONE]`."""
    reason = "abort"
    try:
        for chunk in fmt.opening():
            yield _sse(chunk)
        out: RequestOutput | None = first
        while out is not None:
            p.add(out, metrics)
            if out.finished and out.finish_reason == "error":
                yield _sse(failed(p).body())
                break
            if out.new_token_ids or out.new_text or out.finished:  # one chunk per step, even before text is decodable
                yield _sse(fmt.delta(out.new_text, out.finish_reason if out.finished else None, out.new_token_ids))
            out = None if out.finished else await race(anext(agen, None), drain)
        if include_usage and p.finish_reason != "error":
            yield _sse(fmt.usage(p.usage))
        yield b"data: [DONE]\n\n"
        reason = p.finish_reason or "abort"
    except Stopped:
        yield _sse(drain.shutdown_error().body())
        yield b"data: [DONE]\n\n"
        reason = "shutdown"
    finally:
        await close_stream(agen, p, metrics, reason, drain)


async def close_stream(agen: AsyncIterator[RequestOutput], p: Progress, metrics: APIMetrics, reason: str,
                       drain: Drain) -> None:
    """Abort (if unfinished) and account a streamed request, once; also called if the stream never started."""
    if p.closed:
        return
    p.closed = True
    try:
        await agen.aclose()
    finally:
        p.record(metrics, reason)
        metrics.in_flight -= 1
        drain.leave()


class SSEResponse(Response):
    """A text/event-stream response of `stream`'s chunks that closes its request even when the client leaves before
    the first chunk. The client leaving cancels the streaming (the task that runs this), which closes the generator
    and so aborts the backend request. (Starlette's `StreamingResponse` does the same through a task group, a task
    and cancel scopes per response: more work than a short request's own on the first token's path.)"""

    media_type = "text/event-stream"

    def __init__(self, agen: AsyncIterator[RequestOutput], first: RequestOutput, p: Progress, fmt: ChunkFormat,
                 include_usage: bool, metrics: APIMetrics, drain: Drain) -> None:
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.chunks = stream(agen, first, p, fmt, include_usage, metrics, drain)
        self._close = lambda: close_stream(agen, p, metrics, "abort", drain)

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        state = {"sending": True, "gone": False}

        async def watch() -> None:  # the client's disconnect; after the last chunk `receive` says so too: ignored
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["sending"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            # The head goes out with the first chunk (ready at once: `start` awaited the first output), back to back,
            # so the client wakes to both rather than to the head alone, the first token still being formatted.
            first = await anext(self.chunks, None)
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["sending"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if self.background is not None:
                await self.background()
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # the client left: nothing more to send (`stream` has closed the request)
        except OSError:
            pass  # the connection broke under a write: as if the client left
        finally:
            state["sending"] = False
            watcher.cancel()
            await self.chunks.aclose()
            await self._close()

"""The OpenAI-compatible HTTP server: `build_app(backend)` (FastAPI), `serve(...)` (uvicorn) and `BackgroundServer`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health (200 / 503, answered even while the backend is broken), GET /metrics (Prometheus).
The app starts the backend on startup and shuts it down on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvflow.api import generation as gen
from kvflow.api.errors import APIError, install_error_handlers
from kvflow.api.metrics import APIMetrics
from kvflow.api.prepare import Prepared, prepare_chat, prepare_completion
from kvflow.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, new_id
from kvflow.serving.backend import Backend

log = logging.getLogger(__name__)


class _StatusCounter:
    """ASGI middleware counting responses per (path, status) without touching the body stream."""

    def __init__(self, app, metrics: APIMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_response(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(backend: Backend) -> FastAPI:
    metrics = APIMetrics()
    vocab_size = getattr(backend.tokenizer, "vocab_size", None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.shutdown()

    app = FastAPI(title="kvflow", summary="OpenAI-compatible API over a kvflow backend", lifespan=lifespan)
    app.add_middleware(_StatusCounter, metrics=metrics)
    install_error_handlers(app)
    app.state.backend, app.state.metrics = backend, metrics

    def healthy() -> bool:
        try:
            return bool(backend.healthy())
        except Exception:  # a broken backend must not break /health
            log.exception("backend.healthy() raised")
            return False

    async def respond(request: Request, prepared: Prepared, chat: bool) -> Response:
        if not healthy():
            raise APIError(503, "the serving backend is not healthy; try again later", "server_error", None, "backend_unavailable")
        request_id = new_id("chatcmpl" if chat else "cmpl")
        fmt = gen.ChunkFormat(chat, request_id, backend.model_name)
        progress = gen.Progress(len(prepared.prompt_token_ids))
        metrics.in_flight += 1
        streaming = False
        try:
            agen, first = await gen.start(backend, prepared, request_id, request)
            if prepared.stream:
                streaming = True
                return gen.SSEResponse(agen, first, progress, fmt, prepared.include_usage, metrics)
            await gen.whole(agen, first, progress, metrics, request)
            progress.record(metrics, progress.finish_reason)
            if progress.finish_reason == "error":
                raise gen.failed(progress)
            return JSONResponse(fmt.response(progress).model_dump())
        except gen.ClientGone:
            progress.record(metrics, "abort")
            return Response(status_code=499)  # nobody reads it: the client has gone
        finally:
            if not streaming:
                metrics.in_flight -= 1

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = prepare_completion(body, backend.model_name, backend.tokenizer, backend.max_model_len, vocab_size)
        return await respond(request, prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepared = prepare_chat(body, backend.model_name, backend.tokenizer, backend.max_model_len)
        return await respond(request, prepared, chat=True)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=backend.model_name, max_model_len=backend.max_model_len, vocab_size=vocab_size)])

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        try:
            stats = backend.stats()
        except Exception:
            log.exception("backend.stats() raised")
            stats = None
        return PlainTextResponse(metrics.render(stats, healthy()), media_type="text/plain; version=0.0.4")

    return app


def _config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")


def serve(backend: Backend, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    uvicorn.Server(_config(build_app(backend), host, port, log_level)).run()


class BackgroundServer:
    """Runs the app under uvicorn in a daemon thread on a port the OS picks (tests, in-process benchmarks)."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = build_app(backend)
        self.server = uvicorn.Server(_config(self.app, host, self.port, log_level))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True,
                                       name=f"kvflow-api-{self.port}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("the API server failed to start")
            threading.Event().wait(0.05)
        raise RuntimeError("the API server did not start within 30 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

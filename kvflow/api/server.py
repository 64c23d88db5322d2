"""The OpenAI-compatible HTTP server: `build_app(backend, config)` (FastAPI), `serve(...)` (uvicorn) and `BackgroundServer`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /v1/models/{id} (the served model's card; 404 `model_not_found` for any other id), GET /health
(200 "ok", 200 "degraded" while a worker is being replaced, 503 "unhealthy"; answered even while the
backend is broken), GET /metrics (Prometheus).
With an API key every route but `APIConfig.open_paths` needs `Authorization: Bearer <key>`.
The app starts the backend on startup; on shutdown (SIGTERM, Ctrl-C) the server stops accepting,
drains in-flight requests up to `APIConfig.drain_timeout_s` (`kvflow.api.drain`), then shuts the
backend down, and a SIGTERM-initiated shutdown exits 0. A backend that fails for good (the
controller could not replace a lost worker, the engine thread died) shuts `serve` down with exit
code 1, so that a supervisor (systemd, Kubernetes) restarts the server. A second SIGTERM / Ctrl-C during
the drain ends it at once (requests still running stop with `server_shutdown`, the backend is shut down
as usual) and `serve` returns 128 + that signal's number.

Hostile input is bounded before it costs anything: a body over `APIConfig.max_body_bytes` is refused
with 413 before it is parsed, metric labels come from fixed sets (both middlewares of `kvflow.api.middleware`),
and prompts are tokenized off the event loop, a large one on its own thread (`Tokenizing`) and only
until it passes the context (`kvflow.api.prepare`); a short prompt of token ids, with nothing to tokenize,
is checked on the loop. A valid generation request goes from the middlewares straight to its endpoint
(`DirectRoutes`); FastAPI's routing answers everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvflow.api import generation as gen
from kvflow.api.drain import CANCEL_GRACE_S, Drain
from kvflow.api.errors import APIError, bad_request, install_error_handlers, unavailable
from kvflow.api.metrics import CONTENT_TYPE, APIMetrics
from kvflow.api.middleware import APIKeyAuth, BodyLimit, DirectRoutes, StatusCounter, default_max_body_bytes
from kvflow.api.prepare import (Prepared, piece_chars, prepare_chat, prepare_completion, prompt_chars,
                                token_id_prompt)
from kvflow.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, new_id
from kvflow.serving.backend import Backend

log = logging.getLogger(__name__)
_uvicorn_log = logging.getLogger("uvicorn.error")  # where `kvflow serve` prints server lifecycle lines

TOKENIZER_THREADS = 4  # chat templating + tokenization of ordinary prompts run here, never on the event loop
INLINE_PROMPT_IDS = 2048  # a prompt of at most this many token ids is checked on the event loop (no thread hop)
LARGE_TOKENIZER_THREADS = 1  # prompts longer than one tokenization piece (`piece_chars`) queue for these


@dataclass(frozen=True)
class APIConfig:
    """How the app guards and stops itself. `api_key` None: no authentication."""

    api_key: str | None = None
    open_paths: tuple[str, ...] = ("/health", "/metrics")  # answered without the key
    drain_timeout_s: float = 30.0  # on shutdown: how long in-flight requests may still run
    max_body_bytes: int | None = None  # larger request bodies get 413; None: `default_max_body_bytes(context)`

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("the API key must be a non-empty string without surrounding whitespace")
        if any(not p.startswith("/") for p in self.open_paths):
            raise ValueError(f"open paths must start with '/', got {self.open_paths}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"the drain timeout must be >= 0 seconds, got {self.drain_timeout_s}")
        if self.max_body_bytes is not None and self.max_body_bytes <= 0:
            raise ValueError(f"the request body limit must be > 0 bytes, got {self.max_body_bytes}")


class Tokenizing:
    """Where `prepare_*` runs: a thread pool whenever there is text to tokenize or template, never the event
    loop (only a prompt of at most `INLINE_PROMPT_IDS` token ids is checked there). A prompt longer than one
    tokenization piece (`piece_chars(context)` characters) goes to its own small pool, so a few huge prompts
    queue behind each other there while ordinary requests keep the other pool to themselves."""

    def __init__(self, max_model_len: int) -> None:
        self.large_chars = piece_chars(max_model_len)
        self.small = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvflow-tokenize")
        self.large = ThreadPoolExecutor(LARGE_TOKENIZER_THREADS, thread_name_prefix="kvflow-tokenize-large")

    async def run(self, fn: Callable[[], Prepared], chars: int, token_ids: bool = False) -> Prepared:
        """`fn()`'s answer; `chars`: the prompt's characters, or its token ids when `token_ids` (nothing to tokenize:
        a short one is checked at once, on the event loop — the hop to a thread and back would cost more)."""
        if token_ids and chars <= INLINE_PROMPT_IDS:
            return fn()
        pool = self.large if chars > self.large_chars else self.small
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)


def build_app(backend: Backend, config: APIConfig = APIConfig()) -> FastAPI:
    metrics = APIMetrics()
    drain = Drain(config.drain_timeout_s)
    vocab_size = getattr(backend.tokenizer, "vocab_size", None)
    tokenizing = Tokenizing(backend.max_model_len)
    max_body = config.max_body_bytes or default_max_body_bytes(backend.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await drain.run()  # no-op if the server already drained (it does, before closing connections)
            await backend.shutdown()
            tokenizing.shutdown()

    app = FastAPI(title="kvflow", summary="OpenAI-compatible API over a kvflow backend", lifespan=lifespan)
    direct: dict = {}  # the generation routes, for `DirectRoutes` (filled below)
    app.add_middleware(DirectRoutes, routes=direct)  # added first = innermost: sees bodies within the limit
    app.add_middleware(BodyLimit, limit=max_body)  # inside the key check: a stranger's body is never read
    if config.api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=config.api_key, open_paths=config.open_paths)
    app.add_middleware(StatusCounter, metrics=metrics, routes=app.routes)  # added last = outermost: counts 401s, 413s
    install_error_handlers(app)
    app.state.backend, app.state.metrics, app.state.drain = backend, metrics, drain
    app.state.max_body_bytes = max_body

    def healthy() -> bool:
        try:
            return bool(backend.healthy())
        except Exception:  # a broken backend must not break /health
            log.exception("backend.healthy() raised")
            return False

    def admit() -> None:
        drain.admit()
        if not healthy():
            raise unavailable("the serving backend is not healthy; try again later")

    async def respond(request: Request, prepare: Callable[[], Prepared], chars: int, chat: bool,
                      token_ids: bool = False) -> Response:
        admit()
        drain.enter()  # in flight from here, tokenization included: a drain waits for it
        metrics.in_flight += 1
        streaming = False  # once the SSE response owns the request, it does the accounting (`close_stream`)
        try:
            prepared = await tokenizing.run(prepare, chars, token_ids)
            request_id = new_id("chatcmpl" if chat else "cmpl")
            fmt = gen.ChunkFormat(chat, request_id, backend.model_name, prepared.return_token_ids)
            progress = gen.Progress(len(prepared.prompt_token_ids))
            try:
                agen, first = await gen.start(backend, prepared, request_id, request, drain)
                if prepared.stream:
                    streaming = True
                    return gen.SSEResponse(agen, first, progress, fmt, prepared.include_usage, metrics, drain)
                await gen.whole(agen, first, progress, metrics, request, drain)
            except gen.ClientGone:
                progress.record(metrics, "abort")
                return Response(status_code=499)  # nobody reads it: the client has gone
            except gen.Stopped:
                progress.record(metrics, "shutdown")
                raise drain.shutdown_error() from None
            progress.record(metrics, progress.finish_reason)
            if progress.finish_reason == "error":
                raise gen.failed(progress)
            return JSONResponse(fmt.response(progress).model_dump())
        finally:
            if not streaming:
                metrics.in_flight -= 1
                drain.leave()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepare = partial(prepare_completion, body, backend.model_name, backend.tokenizer, backend.max_model_len, vocab_size)
        return await respond(request, prepare, prompt_chars(body), chat=False, token_ids=token_id_prompt(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepare = partial(prepare_chat, body, backend.model_name, backend.tokenizer, backend.max_model_len, vocab_size)
        return await respond(request, prepare, prompt_chars(body), chat=True)

    direct.update({"/v1/completions": (CompletionRequest, completions),
                   "/v1/chat/completions": (ChatCompletionRequest, chat_completions)})

    def card() -> ModelCard:
        return ModelCard(id=backend.model_name, root=backend.model_name, max_model_len=backend.max_model_len,
                         vocab_size=vocab_size)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")  # `openai`'s models.retrieve; ids may hold '/' (org/name)
    async def model(model_id: str) -> ModelCard:
        if model_id != backend.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{backend.model_name}'",
                           "invalid_request_error", "model", "model_not_found")
        return card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not healthy():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        try:
            why = backend.degraded()
        except Exception:
            log.exception("backend.degraded() raised")
            why = None
        if why:  # serving, with a delay: requests queue until the recovery ends
            return JSONResponse({"status": "degraded", "reason": why}, status_code=200)
        return JSONResponse({"status": "ok"}, status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            stats = backend.stats()
        except Exception:
            log.exception("backend.stats() raised")
            stats = None
        extra = getattr(backend, "metric_families", None)  # optional: a backend with metrics of its own (the router)
        return Response(metrics.render(stats, healthy(), extra() if extra else ()), media_type=CONTENT_TYPE)

    if hasattr(backend, "kv_blocks"):  # an engine: other instances may pull its prompts' KV (the router's P/D pools)
        from kvflow.streaming.kv_pull import PULL_PATH

        @app.post(PULL_PATH, include_in_schema=False)
        async def kv_pull(request: Request) -> Response:
            body = await request.body()
            try:  # a copy out of the KV cache: off the event loop
                parts = await asyncio.to_thread(backend.kv_blocks, body)
            except ValueError as e:
                raise bad_request(str(e), "hashes") from None
            if parts is None:
                return Response(status_code=204)  # none of them here (any more)
            return Response(b"".join(parts), media_type="application/octet-stream")

    return app


class _Server(uvicorn.Server):
    """uvicorn with kvflow's shutdown: stop accepting, drain the app (`Drain.run`), then uvicorn's own shutdown
    (close connections, lifespan → backend.shutdown). A SIGTERM that ends in a clean shutdown exits 0 instead
    of being re-raised at exit as uvicorn does. A second SIGTERM / Ctrl-C cuts the drain short (`Drain.cut`):
    uvicorn's own second Ctrl-C (`force_exit`) would skip the application's shutdown and leave the backend's
    workers running, so it is not used; `stopped_by` keeps that signal for the exit code."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, exit_on_backend_failure: bool = False,
                 on_listening: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.exit_on_backend_failure = exit_on_backend_failure
        self.on_listening = on_listening
        self.backend_failed = False
        self.stopped_by: int | None = None  # the second signal, which cut the drain short
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the backend started (lifespan), then the sockets listen
        if self.started and self.on_listening is not None:
            self.on_listening()

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread, between two bytecodes of whatever runs): the first signal starts the
        shutdown as in uvicorn; the next one asks the event loop to cut the drain short."""
        if not self.should_exit:
            return super().handle_exit(sig, frame)
        if self.stopped_by is None and self._loop is not None:
            self.stopped_by = sig
            self._loop.call_soon_threadsafe(self._cut)

    def _cut(self) -> None:
        drain: Drain = self.app.state.drain
        _uvicorn_log.warning("Second %s: the drain ends now (%d request(s) still running are cancelled)",
                             signal.Signals(self.stopped_by).name, drain.in_flight)
        # what is left: requests writing their error (CANCEL_GRACE_S), then connections closing, not the whole drain
        self.config.timeout_graceful_shutdown = CANCEL_GRACE_S
        drain.cut()

    async def on_tick(self, counter: int) -> bool:
        # every 0.5 s: a backend that can no longer serve (its recovery failed, its engine thread
        # died) ends the process, so that a supervisor restarts it instead of a 503-forever zombie
        if self.exit_on_backend_failure and counter % 5 == 0 and not self.should_exit and not self.backend_failed:
            try:
                ok = bool(self.app.state.backend.healthy())
            except Exception:
                ok = False
            if not ok:
                _uvicorn_log.error("The serving backend failed and cannot recover; shutting down (exit code 1)")
                self.backend_failed = True
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signals it caught once it has stopped: not a SIGTERM that ended in a clean
            # shutdown (exit 0), nor any after a second signal (`serve` returns the exit code, no traceback)
            self._captured_signals = [] if self.stopped_by is not None else \
                [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting new connections
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):  # idle keep-alive ones close; busy ones after their response
            connection.shutdown()
        drain: Drain = self.app.state.drain
        if drain.in_flight and not drain.cut_short:
            _uvicorn_log.info("Draining %d in-flight request(s) for up to %g s (a second SIGTERM or Ctrl-C ends it now)",
                              drain.in_flight, drain.timeout_s)
        await drain.run()
        if drain.cut_short:
            _uvicorn_log.warning("Drain cut short by a second signal: the requests still running were cancelled")
        elif drain.expired.is_set():
            _uvicorn_log.warning("Drain timeout (%g s) passed: the requests still running were cancelled", drain.timeout_s)
        await super().shutdown(sockets)


def _config(app: FastAPI, host: str, port: int, log_level: str, config: APIConfig) -> uvicorn.Config:
    # uvicorn's own graceful timeout only backs up the drain (which ends every request itself)
    grace = config.drain_timeout_s + 10
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace, lifespan="on")


def serve(backend: Backend, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          config: APIConfig = APIConfig(), sock: socket.socket | None = None,
          on_listening: Callable[[], None] | None = None, build: Callable[[Backend, APIConfig], FastAPI] = build_app,
          exit_on_backend_failure: bool = True) -> int:
    """Serve until SIGTERM / Ctrl-C, then drain and shut down (see the module docstring). Returns the
    process exit code: 0 after a shutdown, 1 when the backend failed for good (see `_Server.on_tick`),
    128 + the signal's number when a second signal cut the drain short. `sock`: a socket already bound
    to host:port (`kvflow serve` binds it before loading the model, so a busy port fails at once); it
    starts listening once the backend has started, and then `on_listening()` is called. `build` makes the
    app (`kvflow router` adds its routes); `exit_on_backend_failure=False` answers 503s instead of exiting
    (the router, whose instances may come back)."""
    app = build(backend, config)
    server = _Server(_config(app, host, port, log_level, config), app, exit_on_backend_failure=exit_on_backend_failure,
                     on_listening=on_listening)
    server.run(sockets=None if sock is None else [sock])
    if server.backend_failed:
        return 1
    return 128 + server.stopped_by if server.stopped_by is not None else 0


class BackgroundServer:
    """Runs the app under uvicorn in a daemon thread on a port the OS picks (tests, in-process benchmarks).
    Leaving the `with` block shuts it down as SIGTERM would (drain included)."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", log_level: str = "warning",
                 config: APIConfig = APIConfig()) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = build_app(backend, config)
        self.server = _Server(_config(self.app, host, self.port, log_level, config), self.app)
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

    def stop(self) -> None:
        """Begin the shutdown (returns at once; `join` waits for it)."""
        self.server.should_exit = True

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()
        self.join(self.server.config.timeout_graceful_shutdown + 15)
        self.sock.close()

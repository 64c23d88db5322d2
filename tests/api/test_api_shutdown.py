"""Graceful shutdown: stop accepting, let in-flight requests finish up to the drain timeout, then cancel the rest
with a clear error; a second SIGTERM / Ctrl-C ends the drain at once (`kvflow serve` exiting 0 on one SIGTERM, with a
stream in flight: test_api_cli.py). Every signal is sent after an event (a streamed token, the engine held at a step,
a log line), never after a sleep."""

from __future__ import annotations

import itertools
import logging
import signal
import sys
from contextlib import contextmanager

import httpx
import pytest
from api_helpers import MODEL, in_flight, in_thread, sse_events, tiny_backend, wait_until
from gated import GatedEngine, GatedTokenizer
from servers import SMALL_KV, ServeProcess

from kvflow.api.server import APIConfig, BackgroundServer
from kvflow.serving.backend import EngineBackend

STREAM = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 20, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}


def gated_server(ckpt, drain_timeout_s: float) -> tuple[EngineBackend, GatedEngine, BackgroundServer]:
    backend = tiny_backend(ckpt, GatedEngine)
    return backend, backend.engine, BackgroundServer(backend, config=APIConfig(drain_timeout_s=drain_timeout_s))


@contextmanager
def held_stream(url: str, eng: GatedEngine | None, body: dict):
    """A streamed completion, once its first event is out (and `eng`, held after two more steps, holds):
    yields the stream's lines, that first one included."""
    if eng is not None:
        eng.hold_after(2)  # the request gets two tokens out, then its next step waits
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert eng is None or eng.holding.wait(60)
        yield itertools.chain([first], lines)


def test_in_flight_stream_finishes_during_drain(tiny_ckpt_dir):
    backend, eng, srv = gated_server(tiny_ckpt_dir, drain_timeout_s=120)
    with srv:
        with held_stream(srv.url, eng, STREAM) as lines:
            srv.stop()  # what SIGTERM does
            assert srv.app.state.drain.started.wait(60)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{srv.url}/health", timeout=10)
            assert srv.thread.is_alive()  # still draining: the request is in flight
            eng.release()
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert all("error" not in c for c in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 20
        srv.join(60)
        assert not srv.thread.is_alive() and not backend.healthy()  # shut down, backend stopped


@pytest.fixture
def server_errors():
    """ERROR records from uvicorn, asyncio and kvflow while the test runs (e.g. "aclose(): asynchronous generator is
    already running", "Task exception was never retrieved")."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "asyncio", "kvflow")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def test_drain_timeout_cancels_with_a_clear_error(tiny_ckpt_dir, server_errors):
    backend, eng, srv = gated_server(tiny_ckpt_dir, drain_timeout_s=0.5)
    with srv:
        with held_stream(srv.url, eng, STREAM) as lines:
            # a non-streaming request, waiting for admission behind the held step
            t, whole = in_thread(lambda: httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "w9"}], "max_tokens": 4}))
            wait_until(lambda: in_flight(srv) == 2, 30, "both requests to be in flight")
            srv.stop()
            events = sse_events(lines)  # the engine stays held: only the drain timeout can end them
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == "server_shutdown" and err["type"] == "server_error" and "drain timeout" in err["message"]
        t.join(60)
        r = whole["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        eng.release()
        srv.join(60)
        assert not srv.thread.is_alive()
    # the backend aborted both requests: nothing is left running in the engine
    assert not backend.engine.requests and not backend.engine.has_unfinished()
    assert not server_errors, [r.getMessage() for r in server_errors]


def test_request_being_tokenized_is_drained(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir)
    tok = backend.tokenizer = GatedTokenizer(tiny_ckpt_dir)
    srv = BackgroundServer(backend, config=APIConfig(drain_timeout_s=120))
    with srv:
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True}
        t, out = in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120))
        assert tok.entered.wait(60)  # held inside tokenization
        srv.stop()
        assert srv.app.state.drain.started.wait(60)
        tok.release.set()
        t.join(120)
        r = out["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        srv.join(60)
        assert not srv.thread.is_alive()


def test_requests_on_a_kept_alive_connection_get_503_while_draining(tiny_ckpt_dir):
    backend, eng, srv = gated_server(tiny_ckpt_dir, drain_timeout_s=120)
    with srv, httpx.Client(timeout=60) as keep:
        assert keep.get(f"{srv.url}/health").status_code == 200  # opens a keep-alive connection
        with held_stream(srv.url, eng, STREAM) as lines:
            app = srv.app
            app.state.drain.draining = True  # the state shutdown puts the app in, before connections are closed
            resp = keep.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 2})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down"
            app.state.drain.draining = False
            eng.release()
            list(lines)


# ------------------------------------------------------------------------------------------- a second signal
HELD = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 200, "ignore_eos": True, "stream": True}  # outlasts the drain


def test_a_second_signal_cuts_the_drain_short(tiny_ckpt_dir, server_errors):
    backend, eng, srv = gated_server(tiny_ckpt_dir, drain_timeout_s=600)
    with srv:
        with held_stream(srv.url, eng, HELD) as lines:
            srv.server.handle_exit(signal.SIGTERM, None)  # what the first SIGTERM does
            assert srv.app.state.drain.started.wait(60)
            srv.server.handle_exit(signal.SIGTERM, None)  # the second: the engine is still held
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == "server_shutdown" and "second shutdown signal" in err["message"]
        eng.release()
        srv.join(60)
        assert not srv.thread.is_alive() and not backend.healthy()  # the backend was shut down all the same
        assert srv.server.stopped_by == signal.SIGTERM and srv.app.state.drain.cut_short
    assert not backend.engine.requests
    assert not server_errors, [r.getMessage() for r in server_errors]


# A `kvflow serve` whose engine holds every step after the third until the backend shuts down: a stream stays
# in flight through the drain for as long as the test needs, with no timing involved.
HELD_SERVE = """
import sys, threading
from kvflow.engine.engine import LLMEngine
from kvflow.serving.backend import EngineBackend
gate, steps = threading.Event(), [0]
step, shutdown = LLMEngine.step, EngineBackend.shutdown
def held(self):
    steps[0] += 1
    if steps[0] > 3:
        gate.wait(120)
    return step(self)
async def released(self):
    print("[test] backend shutdown", file=sys.stderr, flush=True)
    gate.set()
    await shutdown(self)
LLMEngine.step, EngineBackend.shutdown = held, released
from kvflow.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


SIGNALS = [signal.SIGTERM, signal.SIGINT]


@pytest.fixture(scope="module")
def held_serves(tiny_ckpt_dir):
    """A `HELD_SERVE` process for each of `SIGNALS`, all started at once when the first test below runs (each test
    ends its own; leaving the module stops any still running)."""
    procs = {sig: ServeProcess("serve", "--model", str(tiny_ckpt_dir), "--threads", "1", "--served-model-name", MODEL,
                               "--drain-timeout", "600", "--log-level", "info", *SMALL_KV,
                               command=(sys.executable, "-c", HELD_SERVE)) for sig in SIGNALS}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.__exit__()


@pytest.mark.parametrize("sig", SIGNALS, ids=["sigterm", "ctrl-c"])
def test_kvflow_serve_second_signal_ends_the_drain_without_a_traceback(held_serves, sig):
    with held_serves[sig] as srv:
        srv.wait_ready()
        with held_stream(srv.url, None, HELD) as lines:
            srv.send_signal(sig)
            srv.wait_for("Draining 1 in-flight request", 60)
            srv.send_signal(sig)  # the engine is held: only this can end the stream
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutdown"
        assert srv.wait(60) == 128 + sig
    assert "Traceback" not in srv.log and "CancelledError" not in srv.log, srv.log
    assert "[test] backend shutdown" in srv.log and "Application shutdown complete" in srv.log, srv.log

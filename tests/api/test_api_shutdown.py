"""Graceful shutdown: stop accepting, let in-flight requests finish up to the drain timeout, then cancel the rest
with a clear error; `kvflow serve` exits 0 on SIGTERM; a second SIGTERM / Ctrl-C ends the drain at once. Every signal is sent after an event (a streamed token,
the engine held at a step), never after a sleep."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from api_helpers import MODEL, tiny_backend, wait_until
from gated import GatedEngine, GatedTokenizer

from kvflow.api.server import APIConfig, BackgroundServer


def _events(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _in_flight(srv: BackgroundServer) -> int:
    for line in httpx.get(f"{srv.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvflow_api_requests_in_flight "):
            return int(float(line.split()[1]))
    raise AssertionError("no in-flight gauge")


STREAM = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 20, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}


def test_in_flight_stream_finishes_during_drain(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir, GatedEngine)
    eng: GatedEngine = backend.engine
    srv = BackgroundServer(backend, config=APIConfig(drain_timeout_s=120))
    with srv:
        eng.hold_after(2)  # the request gets two tokens out, then its next step waits
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json=STREAM) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert eng.holding.wait(60)
            srv.stop()  # what SIGTERM does
            assert srv.app.state.drain.started.wait(60)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{srv.url}/health", timeout=10)
            assert srv.thread.is_alive()  # still draining: the request is in flight
            eng.release()
            events = _events([first, *lines])
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
    backend = tiny_backend(tiny_ckpt_dir, GatedEngine)
    eng: GatedEngine = backend.engine
    srv = BackgroundServer(backend, config=APIConfig(drain_timeout_s=0.5))
    with srv:
        eng.hold_after(2)
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json=STREAM) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert eng.holding.wait(60)
            whole: dict = {}  # a non-streaming request, waiting for admission behind the held step
            t = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
                f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "w9"}],
                                                        "max_tokens": 4}, timeout=60)), daemon=True)
            t.start()
            wait_until(lambda: _in_flight(srv) == 2, 30, "both requests to be in flight")
            srv.stop()
            events = _events([first, *lines])  # the engine stays held: only the drain timeout can end them
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
        out: dict = {}
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True}
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(f"{srv.url}/v1/completions", json=body,
                                                                           timeout=120)), daemon=True)
        t.start()
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
    backend = tiny_backend(tiny_ckpt_dir, GatedEngine)
    eng: GatedEngine = backend.engine
    srv = BackgroundServer(backend, config=APIConfig(drain_timeout_s=120))
    with srv:
        eng.hold_after(2)
        with httpx.Client(timeout=60) as keep, httpx.Client(timeout=60) as http, \
                http.stream("POST", f"{srv.url}/v1/completions", json=STREAM) as r:
            assert keep.get(f"{srv.url}/health").status_code == 200  # opens a keep-alive connection
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert eng.holding.wait(60)
            app = srv.app
            app.state.drain.draining = True  # the state shutdown puts the app in, before connections are closed
            resp = keep.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 2})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down"
            app.state.drain.draining = False
            eng.release()
            list(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_and_exits_0(tiny_ckpt_dir):
    port = _free_port()
    key = "sk-shutdown-test"
    cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--model", str(tiny_ckpt_dir), "--port", str(port),
           "--threads", "1", "--served-model-name", MODEL, "--drain-timeout", "120", "--log-level", "info"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVFLOW_API_KEY": key}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:  # open without the key
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvflow serve did not come up"
            time.sleep(0.2)
        with pytest.raises(openai.AuthenticationError):  # KVFLOW_API_KEY is in force
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        body = {**STREAM, "max_tokens": 200}
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)  # after the first streamed token
            events = _events([first, *lines])
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert all("error" not in c for c in chunks) and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 200
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode()
    assert "Traceback" not in log and "aclose" not in log and "Cancel" not in log, log


# ------------------------------------------------------------------------------------------- a second signal
HELD = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 200, "ignore_eos": True, "stream": True}  # outlasts the drain


def test_a_second_signal_cuts_the_drain_short(tiny_ckpt_dir, server_errors):
    backend = tiny_backend(tiny_ckpt_dir, GatedEngine)
    eng: GatedEngine = backend.engine
    srv = BackgroundServer(backend, config=APIConfig(drain_timeout_s=600))
    with srv:
        eng.hold_after(2)
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json=HELD) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert eng.holding.wait(60)
            srv.server.handle_exit(signal.SIGTERM, None)  # what the first SIGTERM does
            assert srv.app.state.drain.started.wait(60)
            srv.server.handle_exit(signal.SIGTERM, None)  # the second: the engine is still held
            events = _events([first, *lines])
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_kvflow_serve_second_signal_ends_the_drain_without_a_traceback(tiny_ckpt_dir, sig):
    port = _free_port()
    cmd = [sys.executable, "-c", HELD_SERVE, "serve", "--model", str(tiny_ckpt_dir), "--port", str(port), "--threads",
           "1", "--served-model-name", MODEL, "--drain-timeout", "600", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log: list[str] = []
    draining = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            if "Draining 1 in-flight request" in line:
                draining.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "".join(log)
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvflow serve did not come up"
            time.sleep(0.2)
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=HELD) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(sig)
            assert draining.wait(60), "".join(log)
            proc.send_signal(sig)  # the engine is held: only this can end the stream
            events = _events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutdown"
        assert proc.wait(60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    text = "".join(log)
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert "[test] backend shutdown" in text and "Application shutdown complete" in text, text

"""Failure paths on a real server: client disconnects abort the backend request; a failing or dead backend
answers with errors while /health and /metrics keep answering."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from api_helpers import MODEL, FailingEngine, SlowEngine, client, post, tiny_backend, wait_until

from kvflow.api.server import BackgroundServer

LONG = 200  # tokens; at >= 20 ms per step the request would take >= 4 s


def _idle(backend) -> bool:
    s = backend.stats()
    return s.running_requests == 0 and s.waiting_requests == 0 and not backend.engine.requests


def test_client_disconnect_aborts_stream_and_whole(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir, SlowEngine)
    with BackgroundServer(backend) as srv:
        body = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert backend.stats().running_requests == 1
        # the connection is closed: the engine must drop the request long before its 200 tokens
        wait_until(lambda: _idle(backend), 3.0, "the streamed request to be aborted")
        after_stream = backend.stats().generated_tokens_total
        assert after_stream < LONG / 2

        with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up after 0.3 s
            httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
        wait_until(lambda: _idle(backend), 3.0, "the whole-answer request to be aborted")
        assert backend.stats().generated_tokens_total - after_stream < LONG / 2
        # still serving, and the aborts show up in the metrics
        r = client(srv).completions.create(model=MODEL, prompt="w5", max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        assert 'kvflow_request_finished_total{finish_reason="abort"} 2' in httpx.get(f"{srv.url}/metrics").text


def test_backend_failure_is_an_error_and_health_still_answers(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir, FailingEngine)
    with BackgroundServer(backend) as srv:
        c = client(srv)
        with pytest.raises(openai.InternalServerError, match="simulated device failure"):
            c.completions.create(model=MODEL, prompt="w5 w6", max_tokens=4)
        r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "backend_error"
        with pytest.raises(openai.APIError, match="simulated device failure"):  # the error event inside the stream
            for _ in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=4, stream=True):
                pass
        body = {"model": MODEL, "prompt": "w5", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
            events = [e for e in resp.read().decode().split("\n\n") if e]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        assert httpx.get(f"{srv.url}/health").status_code == 200  # the engine thread is alive; requests fail
        assert 'kvflow_request_finished_total{finish_reason="error"} 4' in httpx.get(f"{srv.url}/metrics").text

        asyncio.run(backend.shutdown())  # the engine thread stops: the backend can no longer serve
        h = httpx.get(f"{srv.url}/health")
        assert h.status_code == 503 and h.json() == {"status": "unhealthy"}
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
        m = httpx.get(f"{srv.url}/metrics")
        assert m.status_code == 200 and "kvflow_backend_healthy 0" in m.text and 'kvflow_worker_up{worker="engine"} 0' in m.text

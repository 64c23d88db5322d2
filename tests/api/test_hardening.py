"""Hostile HTTP input costs the server little (issue 39): /metrics labels come from fixed sets, so no path can
inject text or add series (D1, D2); bodies over the limit get 413 before parsing and long prompts are
refused without being tokenized whole, on a tokenizer thread of their own (D3, D4). (D6, the second
signal, is tested with the other shutdown tests, test_api_shutdown.py.) Every wait is for an event (a
gate entered, a stream event), never a sleep."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from api_helpers import MODEL, RecordingTokenizer, client, in_flight, in_thread, tiny_backend, wait_until
from gated import GATE_TIMEOUT_S
from prometheus_client.parser import text_string_to_metric_families

from kvflow.api.metrics import OTHER_ENDPOINT
from kvflow.api.middleware import default_max_body_bytes
from kvflow.api.prepare import check_length, piece_chars, pieces
from kvflow.api.server import APIConfig, BackgroundServer
from kvflow.model.tokenizer import Tokenizer
from kvflow.sched.admission import InvalidRequest

KEY = "sk-hardening"
INJECTION = ("/x%22%2Ccode%3D%22200%22%7D%201%0Akvflow_backend_healthy%200%0Akvflow_forged_metric%7Bby%3D%22anyone"
             "%22%7D%2042%0A%23")


def _families(srv: BackgroundServer) -> dict:
    r = httpx.get(f"{srv.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


# ------------------------------------------------------------------------------------------- D1, D2: /metrics
async def _asgi_get(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """One GET through the app's whole middleware stack, in this thread (no sockets): its status."""
    status = {}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    await app(scope, receive, send)
    return status["code"]


async def _probe(app, n: int) -> list[int]:
    """n distinct unknown paths without the key (401s) and n more with it (404s)."""
    key = [(b"authorization", f"Bearer {KEY}".encode())]
    codes = []
    for i in range(n):
        codes.append(await _asgi_get(app, f"/probe-{i}", []))
        codes.append(await _asgi_get(app, f"/probe-{i}-{i}\n\"", key))
    return codes


def test_metrics_injection_and_label_cardinality(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir), config=APIConfig(api_key=KEY)) as srv:
        routes = {r.path for r in srv.app.routes}
        auth = {"Authorization": f"Bearer {KEY}"}
        # the request from the issue, as curl sends it, with and without the key (a 404 and a 401)
        assert httpx.get(srv.url + INJECTION, timeout=10).status_code == 401
        assert httpx.get(srv.url + INJECTION, headers=auth, timeout=10).status_code == 404
        assert httpx.post(f"{srv.url}/v1/completions", headers=auth, timeout=30,
                          json={"model": MODEL, "prompt": "w5", "max_tokens": 2}).status_code == 200
        fams = _families(srv)
        healthy = [s for f in fams.values() for s in f.samples if s.name == "kvflow_backend_healthy"]
        assert [s.value for s in healthy] == [1.0]  # one series, and the forged 0 is nowhere
        assert all(name.startswith("kvflow_") for name in fams) and "kvflow_forged_metric" not in fams
        http = {(s.labels["endpoint"], s.labels["code"]): s.value for s in fams["kvflow_http_requests"].samples}
        assert {e for e, _ in http} <= routes | {OTHER_ENDPOINT}
        assert http[(OTHER_ENDPOINT, "401")] == 1 and http[(OTHER_ENDPOINT, "404")] == 1
        assert http[("/v1/completions", "200")] == 1
        series = sum(len(f.samples) for f in _families(srv).values())  # (now with the scrape's own 200 series)

        # 10,000 distinct paths more, half of them with the key: not one series more
        assert asyncio.run(_probe(srv.app, 5_000)) == [401, 404] * 5_000
        fams = _families(srv)
        assert sum(len(f.samples) for f in fams.values()) == series
        http = {(s.labels["endpoint"], s.labels["code"]): s.value for s in fams["kvflow_http_requests"].samples}
        assert http[(OTHER_ENDPOINT, "401")] == 5_001 and http[(OTHER_ENDPOINT, "404")] == 5_001
        assert http[("/metrics", "200")] >= 1  # a route's own template


# ------------------------------------------------------------------------------------------- D3: body size
def test_a_body_over_the_limit_is_refused_before_parsing(tiny_ckpt_dir):
    limit = 64 << 10
    with BackgroundServer(tiny_backend(tiny_ckpt_dir), config=APIConfig(max_body_bytes=limit)) as srv:
        assert srv.app.state.max_body_bytes == limit
        big = json.dumps({"model": MODEL, "prompt": "w7 " * 30_000, "max_tokens": 2}).encode()
        assert len(big) > limit
        for headers, content in (({"content-type": "application/json"}, big),  # Content-Length announces it
                                 ({"content-type": "application/json"}, iter([big[:50_000], big[50_000:]]))):  # chunked
            r = httpx.post(f"{srv.url}/v1/completions", content=content, headers=headers, timeout=30)
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and str(limit) in err["message"]
        # a body just within the limit is parsed as usual (and refused for its length, not its size)
        ok = json.dumps({"model": MODEL, "prompt": "w7 " * 20_000, "max_tokens": 2}).encode()
        assert len(ok) <= limit
        r = httpx.post(f"{srv.url}/v1/completions", content=ok, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert client(srv).completions.create(model=MODEL, prompt="w5", max_tokens=2).usage.completion_tokens >= 1
        http = {(s.labels["endpoint"], s.labels["code"]) for s in _families(srv)["kvflow_http_requests"].samples}
        assert ("/v1/completions", "413") in http


def test_four_10_mb_prompts_get_413_by_default_and_a_small_request_is_answered(tiny_ckpt_dir):
    assert default_max_body_bytes(256) == 1 << 20 and default_max_body_bytes(1 << 20) == 32 << 20
    huge = {"model": MODEL, "prompt": " ".join(["w7"] * 3_400_000), "max_tokens": 2}  # 10.2 MB
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        posts = [in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json=huge, timeout=120)) for _ in range(4)]
        small = client(srv).completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
        assert small.usage.completion_tokens == 3
        for t, _ in posts:
            t.join(120)
        assert [out["r"].status_code for _, out in posts] == [413] * 4


# ------------------------------------------------------------------------------------------- D3, D4: tokenizing
def test_pieces_cut_where_whitespace_begins_and_lose_nothing():
    text = "alpha beta\tgamma " * 1000
    parts = list(pieces([text], 100))
    assert "".join(parts) == text and all(100 <= len(p) < 200 for p in parts[:-1])
    assert all(p[-1] != " " and p[-1] != "\t" for p in parts[:-1])  # each cut right before whitespace
    assert [len(p) for p in pieces(["x" * 250], 100)] == [100, 100, 50]  # none near: cut at the size
    assert list(pieces(["a", "b", "c" * 300], 100)) == ["a\nb", "c" * 100, "c" * 100, "c" * 100]


def test_a_prompt_past_the_context_is_refused_after_one_piece(tiny_ckpt_dir):
    tok = RecordingTokenizer(tiny_ckpt_dir)
    size = piece_chars(256)
    with pytest.raises(InvalidRequest, match="characters \\(the rest was not tokenized\\)") as e:
        check_length(tok, ["w7 " * 300_000], 256)  # 900,000 characters
    assert e.value.code == "context_length_exceeded" and e.value.field == "prompt"
    assert sum(tok.sizes) < 2 * size  # one piece (and the empty probe), never the rest
    tok.sizes.clear()
    with pytest.raises(InvalidRequest):
        check_length(tok, ["w7"] * 100_000, 256)  # chat: many messages, counted together
    assert sum(tok.sizes) <= size
    tok.sizes.clear()
    check_length(tok, ["w7 " * 80], 256)  # one piece: left to the caller's own tokenization
    assert tok.sizes == []


def test_long_prompts_are_refused_early_through_the_api_and_one_that_fits_is_exact(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir)
    tok = backend.tokenizer = RecordingTokenizer(tiny_ckpt_dir)
    with BackgroundServer(backend) as srv:
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "w7 " * 300_000, "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "w7 " * 300_000}]})):
            tok.sizes.clear()
            r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert r.json()["error"]["param"] == ("prompt" if "prompt" in body else "messages")
            assert sum(tok.sizes) < 2 * piece_chars(256)
        # longer than a piece but few tokens: counted in pieces, then tokenized whole, so its ids are exact
        text = "w7" + " " * 5000 + "w8 w9"
        r = client(srv).completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(Tokenizer(tiny_ckpt_dir).encode(text)) == 3


class GatedLargeTokenizer(Tokenizer):
    """The real tokenizer; an encode of more than `large` characters first signals `entered` and waits for `release`."""

    def __init__(self, directory, large: int) -> None:
        super().__init__(directory)
        self.large = large
        self.entered, self.release = threading.Event(), threading.Event()
        self.held = 0

    def encode(self, text: str) -> list[int]:
        if len(text) >= self.large:
            self.held += 1
            self.entered.set()
            self.release.wait(GATE_TIMEOUT_S)
        return super().encode(text)


def test_large_prompts_queue_on_their_own_thread_and_a_small_request_is_answered(tiny_ckpt_dir):
    """Four prompts longer than a piece, each held inside tokenization, would take every thread of a single pool
    (`TOKENIZER_THREADS` is 4): a small request must still be tokenized and answered while they wait."""
    backend = tiny_backend(tiny_ckpt_dir)
    size = piece_chars(backend.max_model_len)
    tok = backend.tokenizer = GatedLargeTokenizer(tiny_ckpt_dir, size)
    body = {"model": MODEL, "prompt": "w7 " * 2 * size, "max_tokens": 2}
    with BackgroundServer(backend) as srv:
        posts = [in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)) for _ in range(4)]
        assert tok.entered.wait(60), "no large prompt reached the tokenizer"
        wait_until(lambda: in_flight(srv) == 4, 30, "all four large prompts to be in flight")
        small = client(srv).completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
        assert small.usage.completion_tokens == 3
        assert not tok.release.is_set() and tok.held == 1  # answered while one large prompt is held, three queued
        tok.release.set()
        for t, _ in posts:
            t.join(120)
        assert [out["r"].json()["error"]["code"] for _, out in posts] == ["context_length_exceeded"] * 4

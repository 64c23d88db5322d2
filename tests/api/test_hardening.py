"""Hostile HTTP input costs the server little (issue 39): /metrics labels come from fixed sets, so no path can
inject text or add series (D1, D2)."""

from __future__ import annotations

import asyncio

import httpx
from api_helpers import MODEL, tiny_backend
from prometheus_client.parser import text_string_to_metric_families

from kvflow.api.metrics import OTHER_ENDPOINT
from kvflow.api.server import APIConfig, BackgroundServer

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

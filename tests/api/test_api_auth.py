"""`--api-key`: every route but the open ones needs `Authorization: Bearer <key>`; 401 in the OpenAI error shape."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_helpers import MODEL, tiny_backend

from kvflow.api.server import APIConfig, BackgroundServer
from kvflow.cli.main import main

KEY = "sk-kvflow-test-0123456789"


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir), config=APIConfig(api_key=KEY)) as srv:
        yield srv


def _client(srv: BackgroundServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_right_key_serves_everything(server):
    c = _client(server, KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("key", ["wrong-key", KEY + "x", KEY[:-1]])
def test_wrong_key_is_401_for_the_openai_client(server, key):
    c = _client(server, key)
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model=MODEL, prompt="w5", max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=2, stream=True)


@pytest.mark.parametrize("headers", [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": f"Bearer  {KEY}"}, {"Authorization": f"bearer{KEY}"}],
                         ids=["missing", "no scheme", "basic", "double space", "no space"])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing"), ("GET", "/docs")])
def test_routes_need_the_key(server, headers, method, path):
    r = httpx.request(method, f"{server.url}{path}", headers=headers, json={"model": MODEL, "prompt": "w5"}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key" and err["message"]


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    httpx.get(f"{server.url}/v1/models", timeout=10)  # a 401, counted
    m = httpx.get(f"{server.url}/metrics", timeout=10)
    assert m.status_code == 200 and 'kvflow_http_requests_total{code="401",endpoint="/v1/models"}' in m.text  # labels in name order


def test_open_paths_are_configurable(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir), config=APIConfig(api_key=KEY, open_paths=())) as srv:
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{srv.url}{path}", timeout=10).status_code == 401
            assert httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200


def test_no_key_configured_means_no_auth(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer anything"}, timeout=10)
        assert r.status_code == 200


@pytest.mark.parametrize("bad", ["", " ", " sk-padded"])
def test_bad_keys_are_refused_at_startup(bad, monkeypatch, capsys):
    with pytest.raises(ValueError):
        APIConfig(api_key=bad)
    monkeypatch.delenv("KVFLOW_API_KEY", raising=False)
    assert main(["serve", "--api-key", bad]) == 2  # before any model is loaded
    assert "key" in capsys.readouterr().err


def test_bad_drain_timeout_is_refused(capsys):
    assert main(["serve", "--drain-timeout", "-1"]) == 2
    assert "argument --drain-timeout: must be >= 0" in capsys.readouterr().err  # while parsing

"""The event loop stays free: tokenization runs in worker threads and no engine step blocks a request, so
/health and other clients are answered while a huge prompt is tokenized or a step is running (a huge prompt is
tokenized only until it passes the context: tests/api/test_hardening.py)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from api_helpers import MODEL, RecordingTokenizer, client, in_flight, in_thread, tiny_backend, wait_until
from gated import GatedEngine, GatedTokenizer

from kvflow.api.prepare import piece_chars
from kvflow.api.server import APIConfig, BackgroundServer
from kvflow.serving.backend import EngineBackend

HUGE = " ".join(["w7"] * 1_000_000)  # 3 MB, far beyond the 256-token context


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 2}),
], ids=["completion", "chat"])
def test_health_answers_while_a_huge_prompt_is_tokenized(tiny_ckpt_dir, path, body):
    backend = tiny_backend(tiny_ckpt_dir)
    tok = backend.tokenizer = GatedTokenizer(tiny_ckpt_dir)
    with BackgroundServer(backend, config=APIConfig(max_body_bytes=16 << 20)) as srv:  # over the default limit
        t, out = in_thread(lambda: httpx.post(f"{srv.url}{path}", json=body, timeout=120))
        assert tok.entered.wait(60), "the huge prompt never reached the tokenizer"
        # the tokenizer is now busy with the huge prompt (held until released): the loop must still answer
        h = httpx.get(f"{srv.url}/health", timeout=10)
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
        tok.release.set()
        t.join(120)
        r = out["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # and the server is fine afterwards
        assert client(srv).completions.create(model=MODEL, prompt="w5", max_tokens=2, extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_a_10_mb_prompt_is_refused_after_one_piece_and_a_small_request_is_served(tiny_ckpt_dir):
    """The real tokenizer (no gate) on 10 MB, allowed in by a raised body limit: it is counted piece by piece and
    refused once it passes the context, the rest never tokenized; /health and a small completion are answered."""
    backend = tiny_backend(tiny_ckpt_dir)
    tok = backend.tokenizer = RecordingTokenizer(tiny_ckpt_dir)
    huge = " ".join(["w7"] * 3_400_000)  # 10.2 MB
    with BackgroundServer(backend, config=APIConfig(max_body_bytes=16 << 20)) as srv:
        t, out = in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": huge,
                                                                                   "max_tokens": 2}, timeout=300))
        assert httpx.get(f"{srv.url}/health", timeout=60).json() == {"status": "ok"}
        small = client(srv).completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
        assert small.usage.completion_tokens == 3
        t.join(300)
        assert out["r"].status_code == 400 and out["r"].json()["error"]["code"] == "context_length_exceeded"
        assert max(tok.sizes) < 2 * piece_chars(backend.max_model_len)  # never the whole prompt


def test_no_request_waits_on_an_engine_step(tiny_ckpt_dir):
    """While the engine thread is inside a step, a new request is admitted asynchronously and /health answers."""
    backend = tiny_backend(tiny_ckpt_dir, GatedEngine)
    eng: GatedEngine = backend.engine
    with BackgroundServer(backend) as srv:
        eng.hold_after(2)
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True}
        ta, a = in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120))
        assert eng.holding.wait(60), "the engine never reached the held step"
        tb, b = in_thread(lambda: httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": "w9"}, timeout=120))
        wait_until(lambda: in_flight(srv) == 2, 30, "the second request to be in flight")  # its submission is pending
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        eng.release()
        ta.join(120)
        tb.join(120)
        assert a["r"].json()["usage"]["completion_tokens"] == 8 and b["r"].json()["usage"]["completion_tokens"] == 8


class StaleHealthBackend(EngineBackend):
    """Reports healthy from a stale view (as a controller between heartbeats can), so `generate` is reached
    and must say the backend is unavailable itself."""

    def healthy(self) -> bool:
        return True


def test_backend_unavailable_is_503(tiny_ckpt_dir):
    backend = tiny_backend(tiny_ckpt_dir)
    backend = StaleHealthBackend(backend.engine, MODEL)
    with BackgroundServer(backend) as srv:
        assert client(srv).completions.create(model=MODEL, prompt="w5", max_tokens=2).usage.completion_tokens >= 1
        asyncio.run(backend.shutdown())  # the engine thread stops
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "backend_unavailable" and "shut down" in err["message"]


def test_from_config_builds_and_runs_the_engine_on_one_thread_not_the_main_one(tiny_ckpt_dir, monkeypatch):
    # OpenMP gives each thread that starts parallel regions its own team: loading the model on the
    # main thread and stepping on another left two teams, more threads than cores, and slow steps
    # (EngineBackend's class note). The engine is built, warmed and stepped on the engine thread.
    from kvflow.config import EngineConfig
    from kvflow.engine.engine import LLMEngine

    threads: dict[str, set] = {"build": set(), "step": set()}
    build, step = LLMEngine.from_config, LLMEngine.step

    def built(config):
        threads["build"].add(threading.get_ident())
        return build(config)

    def stepped(self):
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(built))
    monkeypatch.setattr(LLMEngine, "step", stepped)
    backend = EngineBackend.from_config(EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=64, block_size=4), MODEL)
    with BackgroundServer(backend) as srv:
        out = client(srv).completions.create(model=MODEL, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.choices[0].text is not None and out.usage.completion_tokens == 3
    assert threads["build"] == threads["step"] == {backend._thread.ident}
    assert threading.main_thread().ident not in threads["build"]
    with pytest.raises(Exception, match="nope"):  # a model that cannot load fails at construction
        EngineBackend.from_config(EngineConfig(model=str(tiny_ckpt_dir / "nope"), num_kv_blocks=64, block_size=4))

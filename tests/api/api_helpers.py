"""Shared helpers for the API tests: a real uvicorn server over an `EngineBackend` on the tiny checkpoint."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai

from kvflow.api.server import BackgroundServer
from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.model.tokenizer import Tokenizer
from kvflow.serving.backend import EngineBackend

MODEL = "tiny"


def tiny_backend(ckpt: Path, engine_cls: type[LLMEngine] = LLMEngine) -> EngineBackend:
    engine = engine_cls.from_config(EngineConfig(model=str(ckpt), num_kv_blocks=256, block_size=4))
    return EngineBackend(engine, MODEL)


def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def post(server: BackgroundServer, path: str, body, timeout: float = 30) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)
    return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=timeout)


def sse_events(lines) -> list[dict | str]:
    """The `data:` events of a server-sent stream's lines: decoded JSON, and the final "[DONE]"."""
    return [d if (d := line[6:]) == "[DONE]" else json.loads(d) for line in lines if line.startswith("data: ")]


def in_flight(server) -> int:
    """The API's in-flight request gauge, from /metrics of `server` (anything with a `url`)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvflow_api_requests_in_flight "):
            return int(float(line.split()[1]))
    raise AssertionError("no in-flight gauge")


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """`fn()` on a daemon thread: the thread, and a dict that holds its result under "r" once it returned."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class RecordingTokenizer(Tokenizer):
    """The checkpoint's real tokenizer, not held: it records how many characters each encode got."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.sizes: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.sizes.append(len(text))
        return super().encode(text)


class SlowEngine(LLMEngine):
    """A real engine whose steps take at least 20 ms, so a request lasts long enough to disconnect mid-way."""

    def step(self):
        time.sleep(0.02)
        return super().step()


class FailingEngine(LLMEngine):
    """A real engine whose forward pass breaks: every step raises, as a bug or a dead device would."""

    def step(self):
        raise RuntimeError("simulated device failure")

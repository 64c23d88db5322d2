"""Shared helpers for the API tests: a real uvicorn server over an `EngineBackend` on the tiny checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai

from kvflow.api.server import BackgroundServer
from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
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


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class SlowEngine(LLMEngine):
    """A real engine whose steps take at least 20 ms, so a request lasts long enough to disconnect mid-way."""

    def step(self):
        time.sleep(0.02)
        return super().step()


class FailingEngine(LLMEngine):
    """A real engine whose forward pass breaks: every step raises, as a bug or a dead device would."""

    def step(self):
        raise RuntimeError("simulated device failure")

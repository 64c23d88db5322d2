"""Real `kvflow serve` instances as subprocesses (tiny checkpoint, batch-invariant, so greedy output is the same on
every instance and however the request was split) and the router's app in a thread of the test process."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvflow.api.server import APIConfig
from kvflow.router.app import build_router_app
from kvflow.router.backend import RouterBackend
from kvflow.router.config import RouterConfig
from conftest import save_tiny_checkpoint, tiny_config
from servers import SMALL_KV, ServeProcess, free_port, stop_all

MODEL = "tiny"
BLOCK = 16  # the instances' KV block size, and the router's prefix-hash block


@pytest.fixture(scope="session")
def tiny_long_ckpt(tmp_path_factory) -> Path:
    """The tiny checkpoint with a 1024-token context: streams long enough to kill an instance in the middle of."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long-ckpt"), tiny_config(max_position_embeddings=1024))


def instance_args(ckpt: Path) -> tuple[str, ...]:
    """`kvflow serve`'s arguments for the checkpoint: batch-invariant, KV blocks of BLOCK tokens, a host tier (what
    an instance of the P/D pools pulls a prompt's KV into), a small device KV cache (`SMALL_KV`)."""
    return ("--model", str(ckpt), "--threads", "1", "--deterministic", "--block-size", str(BLOCK), "--host-kv-bytes", "4M",
            *SMALL_KV, "--served-model-name", MODEL, "--log-level", "warning", "--drain-timeout", "2")


def serve_instance(ckpt: Path) -> ServeProcess:
    """One `kvflow serve` of the checkpoint on a free port (`instance_args`)."""
    return ServeProcess("serve", *instance_args(ckpt))


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    """Until the process at `url` answers /health with 200 (it failing to start fails the test at once)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.1)


def start_instances(ckpt: Path, n: int) -> list[ServeProcess]:
    procs = [serve_instance(ckpt) for _ in range(n)]  # all start at once; then wait for each
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        stop_all(procs, timeout=20)
        raise
    return procs


class RouterThread:
    """The router's app (`build_router_app`) under uvicorn in a daemon thread, on a free port."""

    def __init__(self, config: RouterConfig, ckpt: Path, api: APIConfig = APIConfig(), fleet=None, wait_s: float = 30) -> None:
        self.backend = asyncio.run(RouterBackend.connect(config, str(ckpt), wait_s=wait_s, fleet=fleet))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api.api_key}"} if api.api_key else {}
        app = build_router_app(self.backend, api)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True, name="kvflow-router-test")

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def on_loop(self, fn):
        """Run `fn()` on the router's event loop (where the pool lives) and return its result."""
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def __enter__(self) -> "RouterThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def instances(self) -> dict[str, dict]:
        return {i["url"]: i for i in httpx.get(f"{self.url}/router/instances", headers=self.headers, timeout=10).json()["instances"]}

    def routed(self) -> dict[str, int]:
        return {u: i["routed_total"] for u, i in self.instances().items()}


def body(prompt: list[int], max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def complete(url: str, prompt: list[int], max_tokens: int, **kw) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body(prompt, max_tokens, **kw), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def metric(url: str, name: str) -> dict[tuple, float]:
    """Samples of one metric family from a /metrics page: label values (sorted by label name) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {tuple(v for _, v in sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def until(cond, timeout: float = 180.0) -> None:
    """Poll `cond` (the router's or its instances' state: the event a test waits for) until it holds, failing after
    `timeout` seconds; the tick only paces the polling."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.1)):
        if cond():
            return
        tick.wait(0.1)
    assert cond()

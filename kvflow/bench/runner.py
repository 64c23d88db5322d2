"""The open-loop runner: fires requests at their arrival times whatever the server's state, one rate after another.

Every run is bounded: it sends at most `num_requests` and stops after `max_duration` seconds,
cancelling what is still in flight (counted as unfinished, and aborted server-side by the disconnect).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from kvflow.bench.client import RequestResult, check_local, send
from kvflow.bench.dataset import BenchRequest, DatasetSpec, build_requests
from kvflow.bench.report import summarize
from kvflow.slo import SLO

MAX_DURATION_S = 3600.0


@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    rates: tuple[float, ...] = (1.0,)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    slo: SLO = field(default_factory=SLO)
    max_duration: float = 600.0  # per rate
    model: str | None = None  # None: the first model /v1/models lists
    progress: bool = True
    # Where the vocabulary size comes from when /v1/models has none (a vLLM server): a local
    # checkpoint (GGUF file or HF-style directory; None = the embedded default model).
    tokenizer: str | None = None
    temperature: float = 0.0  # sent with every request (0: greedy; vLLM's client sends none, i.e. 1.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_local(self.url))
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.max_duration <= MAX_DURATION_S:
            raise ValueError(f"max_duration must be in (0, {MAX_DURATION_S:g}] seconds, got {self.max_duration}")


async def server_info(client: httpx.AsyncClient, url: str, model: str | None,
                      tokenizer: str | None = None) -> tuple[str, int, int]:
    """(model id, context length, vocabulary size) from /v1/models; a server that does not list the
    vocabulary size (vLLM) gets it from the local checkpoint `tokenizer` (None: the embedded default)."""
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    cards = r.json()["data"]
    card = next((c for c in cards if model is None or c["id"] == model), None)
    if card is None:
        raise ValueError(f"the server does not serve {model!r} (it serves {[c['id'] for c in cards]})")
    if not card.get("max_model_len"):
        raise ValueError("the server's /v1/models lacks max_model_len (neither kvflow nor vLLM?)")
    vocab = card.get("vocab_size")
    if not vocab:
        from kvflow.model.loader import load_config

        vocab = load_config(tokenizer)[0].vocab_size
    return card["id"], int(card["max_model_len"]), int(vocab)


async def run_rate(client: httpx.AsyncClient, cfg: BenchConfig, model: str, rate: float,
                   requests: list[BenchRequest]) -> dict:
    bar = tqdm(total=len(requests), desc=f"rate {rate:g} req/s", unit="req", disable=not cfg.progress, leave=False)
    results: list[RequestResult] = []

    async def one(req: BenchRequest) -> None:
        res = await send(client, cfg.url, model, req, cfg.temperature)
        results.append(res)
        bar.update(1)

    t0 = time.perf_counter()
    deadline = t0 + cfg.max_duration
    tasks: list[asyncio.Task] = []
    for req in requests:
        wait = t0 + req.arrival - time.perf_counter()
        if t0 + req.arrival > deadline:
            break
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    bar.close()
    return summarize(rate, results, len(tasks), len(requests), duration, cfg.slo)


async def run_sweep(cfg: BenchConfig) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.max_duration + 30.0, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model, max_model_len, vocab = await server_info(client, cfg.url, cfg.model, cfg.tokenizer)
        summaries = []
        for rate in cfg.rates:
            reqs = build_requests(cfg.dataset, rate, vocab, max_model_len)
            summaries.append(await run_rate(client, cfg, model, rate, reqs))
        return summaries

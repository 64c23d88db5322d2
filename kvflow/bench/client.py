"""Sends one streaming /v1/completions request and times it: TTFT, the gaps between chunks, end-to-end latency."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvflow.bench.dataset import BenchRequest

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_local(url: str) -> str:
    """The load generator only ever targets this machine."""
    host = httpx.URL(url).host
    if host not in LOCAL_HOSTS:
        raise ValueError(f"kvflow bench serve only targets 127.0.0.1/localhost, not {host!r}")
    return url.rstrip("/")


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    expected_output_len: int = 0
    ttft: float | None = None  # seconds from send to the first token chunk
    latency: float | None = None  # seconds from send to the last chunk
    chunk_times: list[float] = field(default_factory=list)  # seconds from send, one per chunk with tokens
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (as vLLM's benchmark)."""
        if not self.ok or self.output_len < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency divided by generated tokens (DéjàVu / vLLM normalized latency)."""
        return self.latency / self.output_len if self.ok and self.output_len and self.latency is not None else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("chunk_times")
        return d


async def send(client: httpx.AsyncClient, base_url: str, model: str, req: BenchRequest,
               temperature: float = 0.0) -> RequestResult:
    body = {
        "model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, prompt_len=len(req.prompt_token_ids), expected_output_len=req.max_tokens)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error event")
                    return res
                now = time.perf_counter() - t0
                if chunk.get("choices"):
                    if res.ttft is None:
                        res.ttft = now
                    res.chunk_times.append(now)
                if chunk.get("usage"):
                    res.output_len = int(chunk["usage"]["completion_tokens"])
        res.latency = res.chunk_times[-1] if res.chunk_times else None
        res.ok = res.latency is not None and res.output_len > 0
        if not res.ok:
            res.error = "stream ended without tokens or usage"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res

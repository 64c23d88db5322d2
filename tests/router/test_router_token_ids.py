"""`return_token_ids` on /v1/completions (the extension the router streams through): each choice carries the token
ids its text was decoded from, streamed and whole, and they are the engine's own output."""

from __future__ import annotations

import json

import httpx

from kvflow.api.server import BackgroundServer
from kvflow.sched.sampling import SamplingParams
from tests.api.api_helpers import MODEL, tiny_backend

PROMPT = [7, 8, 9, 10, 11]


def _events(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def test_token_ids_streamed_and_whole_match_the_engine(tiny_ckpt_dir):
    engine = tiny_backend(tiny_ckpt_dir).engine  # a second engine on the same checkpoint: the reference
    req = engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    backend = tiny_backend(tiny_ckpt_dir)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    with BackgroundServer(backend) as server:
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            chunks = [c["choices"][0] for c in _events(r) if c["choices"]]
        plain = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": False}, timeout=30).json()
    streamed = [t for c in chunks for t in c["token_ids"]]
    assert len(whole["token_ids"]) == 6 and streamed == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"] == backend.tokenizer.decode(whole["token_ids"])
    assert "token_ids" not in plain["choices"][0]  # without the flag the answer is the plain OpenAI shape
    assert whole["token_ids"] == req.output_token_ids

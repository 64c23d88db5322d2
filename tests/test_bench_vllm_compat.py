"""`kvflow bench serve` against a server whose /v1/models is vLLM-shaped (no vocab_size)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvflow.bench.runner import server_info


def _client(cards: list[dict]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": cards})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _info(cards, **kw):
    async def go():
        async with _client(cards) as c:
            return await server_info(c, "http://127.0.0.1:8000", **kw)

    return asyncio.run(go())


def test_vllm_models_card_takes_the_vocabulary_from_the_local_checkpoint(tiny_ckpt_dir):
    vllm_card = {"id": "smol", "object": "model", "owned_by": "vllm", "root": "/models/smol", "max_model_len": 2048}
    assert _info([vllm_card], model=None, tokenizer=str(tiny_ckpt_dir)) == ("smol", 2048, 96)
    kvflow_card = dict(vllm_card, vocab_size=49152)  # a server that lists it wins
    assert _info([kvflow_card], model="smol", tokenizer=str(tiny_ckpt_dir)) == ("smol", 2048, 49152)
    with pytest.raises(ValueError, match="max_model_len"):
        _info([{"id": "x", "object": "model"}], model=None)
    with pytest.raises(ValueError, match="does not serve"):
        _info([vllm_card], model="other")

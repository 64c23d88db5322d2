"""The OpenAI-compatible server on a real uvicorn socket, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_helpers import MODEL, client, tiny_backend

from kvflow.api.server import BackgroundServer
from kvflow.engine.llm import LLM
from kvflow.sched.sampling import SamplingParams

PROMPT = "w10 w11 w12 w13"
CHAT = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_ckpt_dir):
    """Greedy outputs of the offline engine on the same checkpoint: what the API must return."""
    llm = LLM(str(tiny_ckpt_dir), num_kv_blocks=256, block_size=4)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return {"completion": llm.generate([PROMPT], p, use_tqdm=False)[0], "chat": llm.chat([CHAT], p, use_tqdm=False)[0]}


def test_completion_matches_engine_greedy(server, reference):
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    ref = reference["completion"]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ref.prompt_token_ids), 12, len(ref.prompt_token_ids) + 12)
    assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_completion_stream_matches_whole(server, reference):
    chunks = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["completion"].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_whole_and_stream_match_engine(server, reference):
    c = client(server)
    ref = reference["chat"]
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 12
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_seed_and_default_max_tokens(server, reference):
    c = client(server)
    words = reference["completion"].text.split()
    stop_word = words[3]
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop_word], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop_word not in r.choices[0].text
    assert r.choices[0].text.split() == words[: words.index(stop_word)]
    a, b = (c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
                                 extra_body={"top_k": 20, "ignore_eos": True}).choices[0].text for _ in range(2))
    assert a == b
    # max_tokens omitted: the rest of the context, capped at 256 (context here is 256)
    r = c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    n_prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 256 - n_prompt and r.choices[0].finish_reason == "length"


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 256 and raw["vocab_size"] == 96
    # what clients written against vLLM read: root, parent, permission entries
    assert raw["root"] == MODEL and raw["parent"] is None and raw["object"] == "model"
    assert raw["permission"][0]["object"] == "model_permission" and raw["permission"][0]["allow_sampling"] is True
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    client(server).completions.create(model=MODEL, prompt="w5 w6", max_tokens=4, extra_body={"ignore_eos": True})
    m = httpx.get(f"{server.url}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    values = _samples(m.text)
    assert values["kvflow_backend_healthy"] == 1
    assert values["kvflow_time_to_first_token_seconds_count"] >= 1
    assert values['kvflow_time_to_first_token_seconds_bucket{le="+Inf"}'] == values["kvflow_time_to_first_token_seconds_count"]
    assert values["kvflow_time_per_output_token_seconds_count"] >= 1
    assert values["kvflow_generation_tokens_total"] >= 4 and values["kvflow_api_generation_tokens_total"] >= 4
    assert values["kvflow_generation_tokens_per_second"] > 0
    assert values['kvflow_worker_busy_seconds_total{worker="engine"}'] > 0
    assert values['kvflow_worker_up{worker="engine"}'] == 1
    for name in ("kvflow_num_requests_waiting", "kvflow_num_requests_running", "kvflow_kv_bytes_streamed_total",
                 "kvflow_api_requests_in_flight"):
        assert name in values
    assert values['kvflow_http_requests_total{code="200",endpoint="/v1/completions"}'] >= 1
    # the engine's KV: idle now, so every block is free or evictable (what the router's placement reads)
    assert values["kvflow_kv_free_tokens"] > 0 and values["kvflow_kv_cache_usage"] == 0.0


def test_model_retrieve_and_unknown_model(server):
    # the `openai` client's models.retrieve: GET /v1/models/{id}, the same card /v1/models lists
    card = client(server).models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    got = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    assert {k: v for k, v in got.items() if k not in ("created", "permission")} == \
        {k: v for k, v in listed.items() if k not in ("created", "permission")}
    for unknown in ("nope", "org/nope"):  # ids with a '/' reach the route too
        r = httpx.get(f"{server.url}/v1/models/{unknown}")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
        assert f"'{unknown}'" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("nope")
    m = httpx.get(f"{server.url}/metrics").text
    assert 'endpoint="/v1/models/{model_id:path}"' in m  # counted under the route template, not the raw path


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

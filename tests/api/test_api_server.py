"""The OpenAI-compatible server on a real uvicorn socket, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_helpers import MODEL, client, post, tiny_backend

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


BAD = [
    ("malformed json", "/v1/completions", '{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", "[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("missing model", "/v1/completions", {"prompt": "w5"}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "w5"}]}, 400, "messages"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "w5"}, 404, "model"),
    ("unknown model chat", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "w5"}]}, 404, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": " ".join(["w7"] * 300)}, 400, "prompt"),
    ("chat too long", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["w7"] * 300)}]}, 400, "messages"),
    ("max_tokens too large", "/v1/completions", {"model": MODEL, "prompt": "w5 w6", "max_tokens": 255}, 400, "max_tokens"),
    ("max_completion_tokens too large", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 10_000}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"model": MODEL, "prompt": "w5", "temperature": -1}, 400, "temperature"),
    ("temperature not a number", "/v1/completions", {"model": MODEL, "prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "w5", "top_p": 0}, 400, "top_p"),
    ("top_k negative", "/v1/completions", {"model": MODEL, "prompt": "w5", "top_k": -5}, 400, "top_k"),
    ("seed negative", "/v1/completions", {"model": MODEL, "prompt": "w5", "seed": -1}, 400, "seed"),
    ("empty stop", "/v1/completions", {"model": MODEL, "prompt": "w5", "stop": [""]}, 400, "stop"),
    ("n=2", "/v1/completions", {"model": MODEL, "prompt": "w5", "n": 2}, 400, "n"),
    ("penalty", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [5, 6, 10_000]}, 400, "prompt"),
    ("batch of prompts", "/v1/completions", {"model": MODEL, "prompt": ["w5", "w6"]}, 400, "prompt"),
    ("stream bad sampling", "/v1/completions", {"model": MODEL, "prompt": "w5", "top_p": 2, "stream": True}, 400, "top_p"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(server, name, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if status == 404:
        assert err["code"] == "model_not_found"


def test_server_keeps_serving_after_bad_requests(server):
    for _, path, body, _, _ in BAD:
        post(server, path, body)
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=MODEL, prompt="w5", max_tokens=1000)
    assert post(server, "/v1/nothing", {}).status_code == 404
    r = c.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 256 and raw["vocab_size"] == 96
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
    assert values['kvflow_http_requests_total{endpoint="/v1/completions",code="200"}'] >= 1


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

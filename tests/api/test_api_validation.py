"""Strict request validation on a real server: a table of bad requests, each with its status and the field it names.

Types are never coerced (a bool, a string or 5.0 where an integer is required is a 400), NaN/Infinity
and invalid Unicode are 400s, and every error carries the OpenAI shape with `param` = the field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_helpers import MODEL, client, tiny_backend

from kvflow.api.server import BackgroundServer

C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "w5"}]
BIG = 2**64


def comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "w5", **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, **kw}


def msg(**m) -> dict:
    return chat(messages=[m])


# (name, path, body, status, param). A dict body is sent as JSON with non-ASCII escaped (so a lone surrogate
# travels as "\ud800", as a hostile client would send it) and NaN/Infinity allowed; str/bytes bodies go raw.
BAD = [
    # -- the body itself
    ("malformed json", C, '{"model": "tiny", "prompt": ', 400, None),
    ("body is a list", C, "[1, 2]", 400, None),
    ("body is a string", C, '"w5"', 400, None),
    ("body is invalid utf-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("empty body", C, "", 400, None),
    # -- model
    ("missing model", C, {"prompt": "w5"}, 400, "model"),
    ("model not a string", C, comp(model=5), 400, "model"),
    ("model lone surrogate", C, comp(model="tiny\ud800"), 400, "model"),
    ("unknown model", C, comp(model="gpt-4"), 404, "model"),
    ("unknown model chat", CH, chat(model="gpt-4"), 404, "model"),
    # -- prompt
    ("missing prompt", C, {"model": MODEL}, 400, "prompt"),
    ("prompt lone high surrogate", C, comp(prompt="w5 \ud800"), 400, "prompt"),
    ("prompt lone low surrogate", C, comp(prompt="\udc00 w5"), 400, "prompt"),
    ("prompt list with surrogate", C, comp(prompt=["\ud800"]), 400, "prompt"),
    ("prompt is a number", C, comp(prompt=5), 400, "prompt"),
    ("prompt is a bool", C, comp(prompt=True), 400, "prompt"),
    ("prompt is null", C, comp(prompt=None), 400, "prompt"),
    ("model is null", C, comp(model=None), 400, "model"),
    ("prompt is an object", C, comp(prompt={"text": "w5"}), 400, "prompt"),
    ("prompt ids with a bool", C, comp(prompt=[5, True]), 400, "prompt"),
    ("prompt ids with a float", C, comp(prompt=[5, 6.0]), 400, "prompt"),
    ("prompt ids with a string", C, comp(prompt=[5, "6"]), 400, "prompt"),
    ("nested prompt ids with a bool", C, comp(prompt=[[5, True]]), 400, "prompt"),
    ("empty prompt", C, comp(prompt=""), 400, "prompt"),
    ("empty token list", C, comp(prompt=[]), 400, "prompt"),
    ("token id out of range", C, comp(prompt=[5, 6, 10_000]), 400, "prompt"),
    ("negative token id", C, comp(prompt=[-1]), 400, "prompt"),
    ("batch of prompts", C, comp(prompt=["w5", "w6"]), 400, "prompt"),
    ("prompt too long", C, comp(prompt=" ".join(["w7"] * 300)), 400, "prompt"),
    # -- max_tokens
    ("max_tokens bool", C, comp(max_tokens=True), 400, "max_tokens"),
    ("max_tokens string", C, comp(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens float", C, comp(max_tokens=5.0), 400, "max_tokens"),
    ("max_tokens zero", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", C, comp(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens too large", C, comp(prompt="w5 w6", max_tokens=255), 400, "max_tokens"),
    ("max_tokens huge", C, comp(max_tokens=10**30), 400, "max_tokens"),
    # -- sampling
    ("temperature string", C, comp(temperature="hot"), 400, "temperature"),
    ("temperature bool", C, comp(temperature=True), 400, "temperature"),
    ("temperature negative", C, comp(temperature=-1), 400, "temperature"),
    ("temperature NaN", C, comp(temperature=float("nan")), 400, "temperature"),
    ("temperature Infinity", C, comp(temperature=float("inf")), 400, "temperature"),
    ("temperature overflows to inf", C, '{"model": "tiny", "prompt": "w5", "temperature": 1e400}', 400, "temperature"),
    ("top_p zero", C, comp(top_p=0), 400, "top_p"),
    ("top_p string", C, comp(top_p="0.5"), 400, "top_p"),
    ("top_k float", C, comp(top_k=1.5), 400, "top_k"),
    ("top_k bool", C, comp(top_k=True), 400, "top_k"),
    ("top_k negative", C, comp(top_k=-5), 400, "top_k"),
    ("min_p above 1", C, comp(min_p=1.5), 400, "min_p"),
    ("min_p string", C, comp(min_p="0.1"), 400, "min_p"),
    ("presence_penalty above 2", C, comp(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency_penalty below -2", C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty zero", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed negative", C, comp(seed=-1), 400, "seed"),
    ("seed 2**64", C, comp(seed=BIG), 400, "seed"),
    ("seed string", C, comp(seed="7"), 400, "seed"),
    ("seed float", C, comp(seed=1.0), 400, "seed"),
    ("ignore_eos string", C, comp(ignore_eos="yes"), 400, "ignore_eos"),
    ("ignore_eos int", C, comp(ignore_eos=1), 400, "ignore_eos"),
    ("min_tokens above max_tokens", C, comp(max_tokens=2, min_tokens=5), 400, "min_tokens"),
    ("min_tokens string", C, comp(min_tokens="1"), 400, "min_tokens"),
    ("stream string", C, comp(stream="true"), 400, "stream"),
    ("stream_options without stream", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("include_usage string", C, comp(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    ("stream bad sampling", C, comp(top_p=2, stream=True), 400, "top_p"),
    # -- stop
    ("empty stop", C, comp(stop=[""]), 400, "stop"),
    ("stop number", C, comp(stop=5), 400, "stop"),
    ("stop list with number", C, comp(stop=["w6", 5]), 400, "stop"),
    ("stop lone surrogate", C, comp(stop="\ud800"), 400, "stop"),
    ("stop_token_ids bool", C, comp(stop_token_ids=[True]), 400, "stop_token_ids[0]"),
    ("stop_token_ids string", C, comp(stop_token_ids="2"), 400, "stop_token_ids"),
    ("stop_token_ids out of range", C, comp(stop_token_ids=[10_000]), 400, "stop_token_ids"),
    # -- unsupported features (rejected, never ignored)
    ("n=2", C, comp(n=2), 400, "n"),
    ("n bool", C, comp(n=True), 400, "n"),
    ("best_of 2", C, comp(best_of=2), 400, "best_of"),
    ("logprobs", C, comp(logprobs=1), 400, "logprobs"),
    ("echo", C, comp(echo=True), 400, "echo"),
    ("echo string", C, comp(echo="yes"), 400, "echo"),
    ("suffix", C, comp(suffix="w9"), 400, "suffix"),
    ("logit_bias", C, comp(logit_bias={"5": 1.0}), 400, "logit_bias"),
    ("presence_penalty string", C, comp(presence_penalty="high"), 400, "presence_penalty"),
    ("user not a string", C, comp(user=5), 400, "user"),
    # -- chat messages
    ("missing messages", CH, {"model": MODEL}, 400, "messages"),
    ("empty messages", CH, chat(messages=[]), 400, "messages"),
    ("messages a string", CH, chat(messages="w5"), 400, "messages"),
    ("message not an object", CH, chat(messages=["w5"]), 400, "messages[0]"),
    ("bad role", CH, msg(role="robot", content="w5"), 400, "messages[0].role"),
    ("missing role", CH, msg(content="w5"), 400, "messages[0].role"),
    ("content a number", CH, msg(role="user", content=5), 400, "messages[0].content"),
    ("content lone surrogate", CH, msg(role="user", content="w5\ud800"), 400, "messages[0].content"),
    ("second message surrogate", CH, chat(messages=[*USER, {"role": "user", "content": "\udfff"}]), 400, "messages[1].content"),
    ("content image part", CH, msg(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages[0].content"),
    ("content part text number", CH, msg(role="user", content=[{"type": "text", "text": 5}]), 400, "messages[0].content"),
    ("content part surrogate", CH, msg(role="user", content=[{"type": "text", "text": "\ud800"}]), 400, "messages[0].content"),
    ("user message without content", CH, msg(role="user"), 400, "messages[0]"),
    ("name not a string", CH, msg(role="user", content="w5", name=5), 400, "messages[0].name"),
    ("chat too long", CH, msg(role="user", content=" ".join(["w7"] * 300)), 400, "messages"),
    # -- chat sampling
    ("max_completion_tokens too large", CH, chat(max_completion_tokens=10_000), 400, "max_completion_tokens"),
    ("max_completion_tokens string", CH, chat(max_completion_tokens="5"), 400, "max_completion_tokens"),
    ("max_completion_tokens zero", CH, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max tokens fields disagree", CH, chat(max_tokens=3, max_completion_tokens=4), 400, "max_completion_tokens"),
    ("chat max_tokens too large", CH, chat(max_tokens=10_000), 400, "max_tokens"),
    ("chat max_tokens float", CH, chat(max_tokens=5.0), 400, "max_tokens"),
    ("chat logprobs string", CH, chat(logprobs="yes"), 400, "logprobs"),
    ("chat logprobs", CH, chat(logprobs=True), 400, "logprobs"),
    ("chat tools", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("chat json response_format", CH, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("chat penalty out of range", CH, chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("chat seed 2**64", CH, chat(seed=BIG), 400, "seed"),
    ("chat ignore_eos string", CH, chat(ignore_eos="yes"), 400, "ignore_eos"),
    ("chat temperature bool", CH, chat(temperature=False), 400, "temperature"),
    ("chat n=3", CH, chat(n=3), 400, "n"),
]


def send(http: httpx.Client, path: str, body) -> httpx.Response:
    raw = json.dumps(body).encode() if isinstance(body, (dict, list)) else body  # ensure_ascii: "\ud800" stays escaped
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def server(tiny_ckpt_dir):
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """One client for the module's requests (each `httpx.post` would build a client of its own, ~40 ms of CPU)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_table_is_big_enough():
    assert len(BAD) >= 60 and len({b[0] for b in BAD}) == len(BAD)


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_names_the_field(http, name, path, body, status, param):
    r = send(http, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if param is not None and err["code"] != "context_length_exceeded":
        assert err["message"].startswith(param) or param.split("[")[0] in err["message"], err
    if status == 404:
        assert err["code"] == "model_not_found"


def test_server_keeps_serving_after_bad_requests(server, http):
    for _, path, body, _, _ in BAD:
        send(http, path, body)
    assert http.get("/health").status_code == 200
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="w5", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=MODEL, prompt="w5", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="max_tokens: Input should be a valid integer"):
        c.completions.create(model=MODEL, prompt="w5", extra_body={"max_tokens": True})
    r = send(http, "/v1/nothing", {})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = c.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    m = http.get("/metrics").text
    assert 'code="500"' not in m  # no bad request ever became an internal error


def test_well_typed_values_at_the_edges_are_accepted(http):
    """The strict schema must not reject what is valid: ints for floats, seed 2**64-1, null optionals, text parts."""
    ok = [
        (C, comp(temperature=1, top_p=1, max_tokens=2, ignore_eos=True)),
        (C, comp(seed=BIG - 1, temperature=0.5, max_tokens=2, ignore_eos=True)),
        (C, comp(prompt=[5, 6], max_tokens=None, stop=None, stop_token_ids=None, seed=None)),
        (C, comp(prompt=[[5, 6]], max_tokens=2, stop=["w9"], stream=False)),
        (C, comp(max_tokens=2, n=None, stream=None, ignore_eos=None, min_tokens=None, echo=None, stream_options=None)),
        (CH, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]}],
                  max_completion_tokens=2)),
        (CH, chat(messages=[*USER, {"role": "assistant", "content": None}, *USER], max_tokens=2, max_completion_tokens=2)),
        (C, comp(prompt="w5 \u00e9\U0001f600", max_tokens=2)),  # valid non-ASCII (a real surrogate pair on the wire)
        (C, comp(max_tokens=2, min_p=0.05, presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2)),
        (CH, chat(max_tokens=2, min_p=0, presence_penalty=0.5, repetition_penalty=1)),
    ]
    for path, body in ok:
        r = send(http, path, body)
        assert r.status_code == 200, (body, r.text)

"""The generation routes' short path: `DirectRoutes` hands a valid JSON request straight to its endpoint and
everything else to the app (whose answers, the 400s included, tests/api/test_api_validation.py checks), and a
short prompt of token ids is checked on the event loop while text is tokenized on a worker thread."""

from __future__ import annotations

import asyncio
import json
import threading

from api_helpers import MODEL, post, sse_events, tiny_backend
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

import kvflow.api.server as server
from kvflow.api.errors import bad_request
from kvflow.api.middleware import DirectRoutes
from kvflow.api.server import INLINE_PROMPT_IDS, BackgroundServer


class Body(BaseModel):
    model_config = ConfigDict(strict=True)
    n: int


def _run(mw: DirectRoutes, method: str, body: bytes, content_type: bytes | None = b"application/json") -> list[dict]:
    """One request through `mw`: the ASGI messages it sent back."""
    headers = [(b"content-type", content_type)] if content_type is not None else []
    scope = {"type": "http", "method": method, "path": "/p", "headers": headers, "query_string": b""}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent


def _middleware(endpoint) -> tuple[DirectRoutes, list]:
    """`DirectRoutes` over an app that records what reaches it (and answers 299 with the body it read)."""
    reached: list = []

    async def app(scope, receive, send) -> None:
        message = await receive()
        reached.append((scope["method"], message["body"]))
        await JSONResponse({"app": True}, status_code=299)(scope, receive, send)

    return DirectRoutes(app, {"/p": (Body, endpoint)}), reached


def _status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_valid_body_goes_to_the_endpoint_and_anything_else_to_the_app():
    seen: list = []

    async def endpoint(body: Body, request) -> JSONResponse:
        seen.append(body)
        return JSONResponse({"n": body.n}, status_code=201)

    mw, reached = _middleware(endpoint)
    sent = _run(mw, "POST", b'{"n": 3}', b"application/json; charset=utf-8")
    assert _status(sent) == 201 and seen == [Body(n=3)] and not reached

    cases = [("POST", b'{"n": "3"}', b"application/json"),  # does not validate (strict)
             ("POST", b'{"n": 3', b"application/json"),  # not JSON
             ("POST", b'{"n": 3}', b"text/plain"),  # another content type
             ("POST", b'{"n": 3}', None),  # none
             ("PUT", b'{"n": 3}', b"application/json")]  # another method
    for method, body, content_type in cases:
        assert _status(_run(mw, method, body, content_type)) == 299
        assert reached.pop() == (method, body)  # the app read the very body the client sent
    assert len(seen) == 1


def test_an_api_error_from_the_endpoint_is_its_response():
    async def endpoint(body: Body, request):
        raise bad_request("n is odd", "n")

    mw, reached = _middleware(endpoint)
    sent = _run(mw, "POST", b'{"n": 3}')
    assert _status(sent) == 400 and not reached
    assert json.loads(sent[1]["body"])["error"] == {"message": "n is odd", "type": "invalid_request_error",
                                                    "param": "n", "code": None}


def test_short_token_id_prompts_are_checked_on_the_event_loop_and_text_on_a_thread(tiny_ckpt_dir, monkeypatch):
    threads: list[str] = []
    prepare = server.prepare_completion

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(server, "prepare_completion", recording)
    with BackgroundServer(tiny_backend(tiny_ckpt_dir)) as srv:
        for prompt in ([5, 6, 7], "w5 w6 w7", [5] * (INLINE_PROMPT_IDS + 1)):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
            r = post(srv, "/v1/completions", body)
            assert r.status_code == 200 or "context" in r.text, r.text  # (the long one passes the tiny context)
            if r.status_code == 200:
                events = sse_events(r.text.splitlines())
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert threads[0] == srv.thread.name  # the event loop's own thread
    assert threads[1].startswith("kvflow-tokenize") and threads[2].startswith("kvflow-tokenize")


def test_a_prompt_sent_as_ids_is_answered_as_its_text_is(tiny_ckpt_dir):
    """The same greedy request as text (tokenized on a thread) and as its ids (checked on the loop)."""
    backend = tiny_backend(tiny_ckpt_dir)
    with BackgroundServer(backend) as srv:
        answers = []
        for prompt in ("w5 w6 w9", backend.tokenizer.encode("w5 w6 w9")):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            r = post(srv, "/v1/completions", body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["token_ids"])
    assert len(answers[0]) == 4 and answers[0] == answers[1]

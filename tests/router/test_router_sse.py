"""The router's instance-side HTTP client (`kvflow.router.sse.SSEClient`) against real HTTP servers: a FastAPI app
under uvicorn that streams SSE as `kvflow serve` does, and raw asyncio servers for the misbehaving cases (a
keep-alive connection closed while idle, a stream cut off before `[DONE]`)."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.router.sse import HTTPFailed, HTTPStatus, SSEClient


def sse_app(gate: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("bad"):
            return JSONResponse({"error": {"message": "bad field"}}, status_code=400)

        async def events():
            for i in range(body["n"]):
                yield f"data: {json.dumps({'i': i, 'echo': body['echo']})}\n\n".encode()
            if body.get("hang"):
                await gate.wait()  # held open until the test sets it
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def serving(app: FastAPI) -> tuple[uvicorn.Server, asyncio.Task, str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"http://127.0.0.1:{port}"


def collect(client: SSEClient, url: str, body: dict, abort_on: asyncio.Event | None = None):
    async def run():
        return [json.loads(d) async for d in client.events(url, "/v1/completions", json.dumps(body).encode(), abort_on)]
    return run()


def test_streams_payloads_and_reuses_the_connection():
    async def main():
        gate = asyncio.Event()
        server, task, url = await serving(sse_app(gate))
        client = SSEClient(connect_timeout_s=5.0)
        try:
            out = await collect(client, url, {"n": 3, "echo": "é ü"})
            assert out == [{"i": i, "echo": "é ü"} for i in range(3)]
            (key, idle), = client._idle.items()
            assert len(idle) == 1  # read to its end: back in the pool
            conn = idle[0]
            assert await collect(client, url, {"n": 1, "echo": "x"}) == [{"i": 0, "echo": "x"}]
            assert client._idle[key] == [conn]  # the same connection served the second request
            with pytest.raises(HTTPStatus) as e:  # an error answer: its status and body
                await collect(client, url, {"bad": True})
            assert e.value.status == 400 and json.loads(e.value.args[0])["error"]["message"] == "bad field"
            # closing the generator early (the router's stop string) drops the connection, not pools it
            agen = client.events(url, "/v1/completions", json.dumps({"n": 5, "echo": "y"}).encode())
            assert json.loads(await anext(agen)) == {"i": 0, "echo": "y"}
            await agen.aclose()
            assert len(client._idle[key]) <= 1
        finally:
            await client.aclose()
            server.should_exit = True
            await task

    asyncio.run(main())


def test_abort_on_breaks_off_a_held_stream():
    async def main():
        gate = asyncio.Event()
        server, task, url = await serving(sse_app(gate))
        client = SSEClient(connect_timeout_s=5.0)
        down = asyncio.Event()
        try:
            agen = client.events(url, "/v1/completions", json.dumps({"n": 1, "echo": "", "hang": True}).encode(), down)
            assert json.loads(await anext(agen))["i"] == 0
            pending = asyncio.ensure_future(anext(agen))
            await asyncio.sleep(0)
            assert not pending.done()  # waiting on the held stream
            down.set()  # the instance is taken out of the pool
            with pytest.raises(HTTPFailed, match="aborted"):
                await pending
            with pytest.raises(HTTPFailed, match="aborted"):  # and a request to it is refused at once
                await collect(client, url, {"n": 1, "echo": ""}, down)
        finally:
            gate.set()
            await client.aclose()
            server.should_exit = True
            await task

    asyncio.run(main())


def test_abort_on_breaks_off_a_request_that_was_never_answered():
    """An instance that hangs with the request in its socket (SIGSTOPped before it wrote the answer's head): once it
    is taken out of the pool the request fails at once, whether its connection was fresh or pooled, and is not sent
    to it again (it used to wait for a head that never came, and the client's stream with it)."""
    async def main():
        whole = chunked(b'data: {"a": 1}\n\ndata: [DONE]\n\n') + b"0\r\n\r\n"
        arrived, release, requests = asyncio.Event(), asyncio.Event(), [0]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                requests[0] += 1
                if requests[0] == 1:  # the first is answered: its connection goes back to the pool
                    writer.write(whole)
                    await writer.drain()
                    continue
                arrived.set()
                await release.wait()  # the others never are
                break
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = SSEClient(connect_timeout_s=5.0)
        try:
            assert await collect(client, url, {}) == [{"a": 1}]
            for fresh in (False, True):  # the pooled connection, then a new one
                if fresh:
                    await client.aclose()
                down = asyncio.Event()
                arrived.clear()
                pending = asyncio.ensure_future(collect(client, url, {}, down))
                await arrived.wait()
                assert not pending.done()  # waiting for the answer's head
                sent = requests[0]
                down.set()  # the instance is taken out of the pool
                with pytest.raises(HTTPFailed, match="aborted"):
                    await asyncio.wait_for(pending, 30)  # (a guard against the old hang, not a timing)
                assert requests[0] == sent  # not sent again
        finally:
            release.set()
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


async def raw_server(answers: list[bytes | None]) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """Reads requests on keep-alive connections and answers the k-th with `answers[k]`; None: closes that connection
    without answering (as a server drops a connection it considers idle, as the request arrives)."""
    served = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            answer = answers[served[0]]
            served[0] += 1
            if answer is None:
                break
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served


def chunked(*events: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body


def test_a_connection_dropped_while_idle_is_replaced_and_a_cut_stream_fails():
    async def main():
        whole = chunked(b'data: {"a": 1}\n\ndata: [DONE]\n\n') + b"0\r\n\r\n"
        cut = b"HTTP/1.1 200 OK\r\ncontent-length: 16\r\n\r\ndata: {\"a\": 2}\n\n"  # the body ends without [DONE]
        server, url, served = await raw_server([whole, None, whole, cut])
        client = SSEClient(connect_timeout_s=5.0)
        try:
            assert await collect(client, url, {}) == [{"a": 1}]
            (key, idle), = client._idle.items()
            first = idle[0]
            assert await collect(client, url, {}) == [{"a": 1}]  # dropped unanswered: sent again on a fresh one
            assert served[0] == 3 and client._idle[key] != [first]
            with pytest.raises(HTTPFailed, match="without"):
                await collect(client, url, {})
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        with pytest.raises(HTTPFailed):
            await collect(SSEClient(connect_timeout_s=5.0), url, {})  # nothing listens there any more

    asyncio.run(main())

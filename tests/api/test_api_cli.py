"""`kvflow serve` as a real subprocess through its whole life: it announces its address once listening,
serves the openai client with the API key in force, drains a stream in flight on SIGTERM and exits 0;
and its flag errors. (A second signal during the drain: test_api_shutdown.py.)"""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
from api_helpers import sse_events
from servers import SMALL_KV, ServeProcess

from kvflow.cli.main import main

MODEL = "tiny-cli"
KEY = "sk-cli-test"


def test_kvflow_serve_announces_serves_and_drains_on_sigterm(tiny_ckpt_dir):
    with ServeProcess("serve", "--model", str(tiny_ckpt_dir), "--threads", "1", "--served-model-name", MODEL,
                      "--drain-timeout", "120", "--log-level", "info", *SMALL_KV, env={"KVFLOW_API_KEY": KEY}) as srv:
        srv.wait_ready()  # announced = listening and started: /health (open without the key) answers at once
        with pytest.raises(openai.AuthenticationError):  # KVFLOW_API_KEY is in force
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w9"}], max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.model == MODEL
        body = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json=body,
                                                           headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.send_signal(signal.SIGTERM)  # after the first streamed token: drain, shut down, exit 0
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert all("error" not in c for c in chunks) and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 200
        assert srv.wait(60) == 0
    assert "Traceback" not in srv.log and "aclose" not in srv.log and "Cancel" not in srv.log, srv.log


def test_serve_mode_flags_are_checked(capsys):
    assert main(["serve", "--prompt-depth", "2"]) == 2
    assert "--prompt-depth" in capsys.readouterr().err
    assert main(["serve", "--mode", "colocated", "--token-depth", "2"]) == 2
    assert "use --depth" in capsys.readouterr().err
    assert main(["serve", "--mode", "disaggregated", "--depth", "2"]) == 2
    assert "--prompt-depth and --token-depth" in capsys.readouterr().err

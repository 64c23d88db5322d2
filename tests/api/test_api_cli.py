"""`kvflow serve` as a real subprocess on a free port, queried with the openai client; and its flag errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai

from kvflow.cli.main import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvflow_serve_subprocess(tiny_ckpt_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "kvflow.cli.main", "serve", "--model", str(tiny_ckpt_dir), "--port", str(port),
           "--threads", "1", "--served-model-name", "tiny-cli", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvflow serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "w9"}], max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.model == "tiny-cli"
    finally:
        proc.terminate()  # SIGTERM: drain, shut down, exit 0
        assert proc.wait(20) == 0
    assert "Traceback" not in proc.stdout.read().decode()


def test_serve_mode_flags_are_checked(capsys):
    assert main(["serve", "--prompt-depth", "2"]) == 2
    assert "--prompt-depth" in capsys.readouterr().err
    assert main(["serve", "--mode", "colocated", "--token-depth", "2"]) == 2
    assert "use --depth" in capsys.readouterr().err
    assert main(["serve", "--mode", "disaggregated", "--depth", "2"]) == 2
    assert "--prompt-depth and --token-depth" in capsys.readouterr().err

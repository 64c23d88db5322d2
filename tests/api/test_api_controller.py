"""The HTTP API over the distributed controller (real worker processes): openai client, and a killed worker."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import threading
import time

import httpx
import openai
import pytest
from servers import SMALL_KV, ServeProcess

from kvflow.api.server import BackgroundServer
from kvflow.controller.controller import Controller
from kvflow.controller.launcher import SubprocessLauncher
from kvflow.config import ClusterConfig, EngineConfig
from kvflow.sched.sampling import SamplingParams

from conftest import run_to_completion, tiny_engine


def _controller(ckpt, **kw) -> Controller:
    kw = {"heartbeat_timeout_s": 3.0, **kw}
    cfg = ClusterConfig(engine=EngineConfig(model=str(ckpt), num_kv_blocks=128, block_size=4), microbatch_size=4,
                        prompt_microbatch_size=2, **kw)
    return Controller(cfg, "tiny")


@pytest.mark.parametrize("kw", [dict(mode="colocated", depth=2), dict(mode="disaggregated")], ids=["colocated-2", "disagg-1-1"])
def test_openai_client_gets_engine_tokens(tiny_ckpt_dir, kw):
    eng = tiny_engine(num_kv_blocks=128, block_size=4)
    ref = eng.add_request([3, 30, 31, 4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    expected = run_to_completion(eng)[ref.request_id].token_ids
    with BackgroundServer(_controller(tiny_ckpt_dir, **kw)) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w30 w31"}], max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        words = [f"w{t}" for t in expected]
        assert r.choices[0].message.content.split() == words
        chunks = c.completions.create(model="tiny", prompt="w10 w11 w12", max_tokens=5, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(text.split()) == 5
        assert httpx.get(f"{server.url}/health").status_code == 200
        m = httpx.get(f"{server.url}/metrics").text
        assert "kvflow_worker_busy_seconds" in m and "kvflow_replication_lag_tokens" in m
        if kw["mode"] == "colocated":  # depth 2: ring replication is on; the workers report its bytes with heartbeats
            deadline = time.monotonic() + 60
            while "kvflow_replicated_bytes_total 0.0\n" in httpx.get(f"{server.url}/metrics").text:
                assert time.monotonic() < deadline, "no replicated bytes reported"
                time.sleep(0.05)


def test_without_recovery_a_killed_worker_fails_the_request_and_health_keeps_answering(tiny_ckpt_dir):
    # Deterministic on any machine speed: after a first request has completed (the prompt->token KV link
    # is up), token-0 is stopped before the victim request arrives, so once the
    # first token (sampled from the prompt pipeline) is out, the request provably has work left that it
    # cannot do; only then is token-0 killed. A long heartbeat timeout leaves the process exit as the
    # only way the failure can be detected.
    ctrl = _controller(tiny_ckpt_dir, mode="disaggregated", heartbeat_timeout_s=120.0, recovery="none")
    with BackgroundServer(ctrl) as server:
        victim = ctrl.stages["token-0"].process
        warm = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "w10", "max_tokens": 2}, timeout=60)
        assert warm.status_code == 200
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            body = {"model": "tiny", "prompt": "w10 w11", "max_tokens": 250, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for line in lines:  # the first token is out: the request is in flight
                    if line.startswith("data: {"):
                        events.append(line)
                        break
                assert events and '"error"' not in events[0]
                os.kill(victim.pid, signal.SIGKILL)
                t0 = time.monotonic()
                events += [line for line in lines if line.startswith("data: ")]
        finally:
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)
        assert time.monotonic() - t0 < ctrl.cfg.heartbeat_timeout_s, "request hung after its worker was killed"
        assert events[-1] == "data: [DONE]"
        errors = [e for e in events if '"error"' in e]
        assert errors and "token-0" in errors[0] and "died" in errors[0]
        assert len(events) == 3, events  # the first token, the error, [DONE]: nothing was generated after the stop
        h = httpx.get(f"{server.url}/health", timeout=5)
        assert h.status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "w10", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503


class GatedLauncher(SubprocessLauncher):
    """Starts the first `initial` workers at once; a replacement only once `gate` is set, so the test
    can look at the server while a recovery is provably in progress."""

    def __init__(self, initial: int) -> None:
        super().__init__()
        self.initial, self.starts, self.gate = initial, 0, threading.Event()

    def start(self, name, controller_addr, host, secret):
        self.starts += 1
        if self.starts > self.initial:
            assert self.gate.wait(120), "the test never opened the gate"
        return super().start(name, controller_addr, host, secret)


def test_health_is_degraded_and_requests_queue_while_a_lost_worker_is_replaced(tiny_ckpt_dir):
    eng = tiny_engine(num_kv_blocks=128, block_size=4)
    ref = eng.add_request([3, 30, 31, 4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    expected = " ".join(f"w{t}" for t in run_to_completion(eng)[ref.request_id].token_ids)
    launcher = GatedLauncher(initial=2)
    cfg = ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=128, block_size=4), mode="colocated",
                        depth=2, microbatch_size=4, heartbeat_timeout_s=120.0)
    ctrl = Controller(cfg, "tiny", launcher)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w30 w31"}], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    with BackgroundServer(ctrl) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        ctrl.stages["colocated-1"].process.kill()
        deadline = time.monotonic() + 60
        while (h := httpx.get(f"{server.url}/health", timeout=5)).json()["status"] != "degraded":
            assert time.monotonic() < deadline, h.json()
            time.sleep(0.02)
        assert h.status_code == 200 and "colocated-1" in h.json()["reason"]
        queued = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body, timeout=120)
        while ctrl.stats().waiting_requests == 0 and not queued.done():  # the request is in, not refused
            time.sleep(0.02)
        assert not queued.done()
        launcher.gate.set()
        r = queued.result()
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert ctrl.recovery.recoveries == 1


def _serve_one_worker(model, *extra: str) -> ServeProcess:
    """`kvflow serve` of `model` in colocated depth 1, started (`_worker` waits until it is ready)."""
    return ServeProcess("serve", "--model", str(model), "--mode", "colocated", "--depth", "1", "--threads", "1",
                        "--served-model-name", "tiny", "--log-level", "info", *SMALL_KV, *extra)


def _worker(srv: ServeProcess) -> int:
    """Its worker's pid (from the line the controller logs when it starts the worker), once it is ready."""
    worker = int(srv.wait_for(r"started worker colocated-0 \(pid (\d+)\)").group(1))
    srv.wait_ready()
    return worker


@pytest.fixture(scope="module")
def one_worker_serves(tiny_ckpt_dir, tmp_path_factory):
    """The `kvflow serve` processes of the two tests below, started at once when the first of them runs (each
    starts in the time the other's test takes): "lost" serves a copy of the checkpoint (its test deletes it) with
    --max-restarts 1, "killed" the checkpoint. Each test ends its own; leaving the module stops any still running."""
    model = tmp_path_factory.mktemp("lost") / "model"
    shutil.copytree(tiny_ckpt_dir, model)
    procs = {"lost": _serve_one_worker(model, "--max-restarts", "1"), "killed": _serve_one_worker(tiny_ckpt_dir)}
    try:
        yield model, procs
    finally:
        for p in procs.values():
            p.__exit__()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_serve_exits_1_when_a_lost_worker_cannot_be_replaced(one_worker_serves):
    """The policy for a supervisor: recovery that fails `max_restarts` times ends the server with
    exit code 1 (here the replacements cannot load the model: its files are gone)."""
    model, procs = one_worker_serves
    with procs["lost"] as srv:
        worker = _worker(srv)
        shutil.rmtree(model)
        os.kill(worker, signal.SIGKILL)
        assert srv.wait(180) == 1
    assert "replacement failed" in srv.log and "cannot recover" in srv.log, srv.log


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_workers_do_not_outlive_a_killed_server(one_worker_serves):
    """SIGKILL leaves `kvflow serve` no chance to stop its workers: each notices on its own that the
    controller process is gone and exits (a worker forked by the fork server is not its child)."""
    with one_worker_serves[1]["killed"] as srv:
        worker = _worker(srv)
        srv.proc.kill()
        srv.proc.wait()
        deadline = time.monotonic() + 60
        while _running(worker):
            assert time.monotonic() < deadline, f"worker {worker} still runs a minute after its server was killed"
            time.sleep(0.1)

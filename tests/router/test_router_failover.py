"""An instance that fails under the router: its requests move to another instance with their generated prefix, and
every client stream goes on — nothing lost, no token twice, greedy output identical to one instance's run.

Killed: SIGKILL once a stream has delivered its 5th token (the event the test waits for); the router sees the
connection break. Hung: SIGSTOP; the router's health checks take the instance out and the streams open on it move.
"""

from __future__ import annotations

import json
import random
import signal
import threading

import httpx
import pytest

from kvflow.router.config import RouterConfig
from router_helpers import (BLOCK, MODEL, RouterThread, complete, metric, start_instances, stop_all,  # noqa: F401
                            tiny_long_ckpt)

MAX_TOKENS = 900
PROMPTS = [random.Random(i).choices(range(5, 96), k=20) for i in range(4)]


@pytest.fixture(scope="module")
def instances(tiny_long_ckpt):
    """The module's instances, three started at once. Its tests run in the order that needs no more: the hung
    instance comes back (SIGCONT), then the P/D test and the SIGKILL test each kill one; `alive` starts more if a
    test finds fewer running than it needs (run alone, or after a test that failed half-way)."""
    procs = start_instances(tiny_long_ckpt, 3)
    yield procs
    stop_all(procs)


@pytest.fixture
def alive(instances, tiny_long_ckpt):
    """`alive(n)`: n of the module's instances that are running (started now if fewer are)."""
    def take(n: int) -> list:
        running = [p for p in instances if p.proc.poll() is None]
        if len(running) < n:
            more = start_instances(tiny_long_ckpt, n - len(running))
            instances.extend(more)
            running += more
        return running[:n]

    yield take
    for p in instances:  # a hung instance whose test failed before it let it go on
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def refs(instances) -> list[dict]:
    """One instance's answers to `PROMPTS`, each request whole (every instance answers the same: batch-invariant):
    what every stream must get, whatever instance it ends on."""
    return [complete(instances[0].url, p, MAX_TOKENS) for p in PROMPTS]


def _stream(url: str, prompt: list[int], out: dict, nth: threading.Event) -> None:
    ids, text, reasons = [], "", []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                ids += choice["token_ids"]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
            if len(ids) >= 5:
                nth.set()
    out.update(ids=ids, text=text, reasons=reasons)


def _run_and_fail(router: RouterThread, fail) -> list[dict]:
    """Four greedy streams at once; `fail(url)` is called for an instance with streams open on it as soon as the
    first stream has its 5th token."""
    outs = [{} for _ in PROMPTS]
    nth = threading.Event()
    threads = [threading.Thread(target=_stream, args=(router.url, p, o, nth)) for p, o in zip(PROMPTS, outs)]
    for t in threads:
        t.start()
    try:
        assert nth.wait(60)
        victim = next(u for u, i in router.instances().items() if i["in_flight"])
        fail(victim)
    finally:
        for t in threads:
            t.join(180)
    return outs, victim


def _check(router: RouterThread, outs: list[dict], refs: list[dict], victim: str) -> None:
    for out, ref in zip(outs, refs):
        assert out["ids"] == ref["token_ids"]  # every token once, in order: none lost, none twice
        assert out["text"] == ref["text"]
        assert out["reasons"][-1] == "length" and out["reasons"].count("length") == 1
    assert metric(router.url, "kvflow_router_failovers_total")[()] >= 1
    assert metric(router.url, "kvflow_router_instance_up")[(victim,)] == 0.0
    assert metric(router.url, "kvflow_router_instance_failures_total")[(victim,)] == 1.0
    resent = metric(router.url, "kvflow_router_resent_tokens_total")[()]
    assert 5 <= resent  # at least the first stream's 5 tokens went with it


def test_hung_instance_is_taken_out_and_its_streams_move(alive, refs, tiny_long_ckpt):
    by_url = {p.url: p for p in alive(2)}
    cfg = RouterConfig(instances=tuple(by_url), policy="round_robin", block_tokens=BLOCK, health_interval_s=0.2,
                       health_timeout_s=0.5, failure_threshold=2)
    with RouterThread(cfg, tiny_long_ckpt) as router:
        outs, victim = _run_and_fail(router, lambda url: by_url[url].proc.send_signal(signal.SIGSTOP))
        _check(router, outs, refs, victim)
        by_url[victim].proc.send_signal(signal.SIGCONT)  # it answers again: the health check brings it back
        deadline = threading.Event()
        for _ in range(100):
            if router.instances()[victim]["healthy"]:
                break
            deadline.wait(0.1)  # (polling the router for the event: no sleep decides the outcome)
        assert router.instances()[victim]["healthy"]


def test_a_decode_instance_killed_mid_stream_in_pd_pools_loses_nothing(alive, refs, tiny_long_ckpt):
    """P/D pools (one prefill, two decode instances): a decode instance SIGKILLed while streams decode there; they
    move to the other decode instance, which pulls what the prefill instance still holds of the prompt and computes
    the rest: every stream the tokens of one instance, none lost or twice."""
    trio = alive(3)
    by_url = {p.url: p for p in trio}
    cfg = RouterConfig(prefill=(trio[0].url,), decode=(trio[1].url, trio[2].url), policy="least_load",
                       block_tokens=BLOCK, health_interval_s=0.2)
    with RouterThread(cfg, tiny_long_ckpt) as router:
        def kill_a_decoder(_):
            victim = next(u for u, i in router.instances().items() if i["in_flight"] and i["role"] == "decode")
            by_url[victim].stop(signal.SIGKILL)
            kill_a_decoder.victim = victim

        outs, _ = _run_and_fail(router, kill_a_decoder)
        _check(router, outs, refs, kill_a_decoder.victim)
        assert metric(router.url, "kvflow_router_handoffs_total")[()] == len(PROMPTS)


def test_sigkill_mid_stream_loses_nothing(alive, refs, tiny_long_ckpt):
    pair = alive(2)
    by_url = {p.url: p for p in pair}
    cfg = RouterConfig(instances=tuple(by_url), policy="least_load", block_tokens=BLOCK, health_interval_s=0.2)
    with RouterThread(cfg, tiny_long_ckpt) as router:
        outs, victim = _run_and_fail(router, lambda url: by_url[url].stop(signal.SIGKILL))
        _check(router, outs, refs, victim)
        (survivor,) = set(by_url) - {victim}
        again = complete(router.url, PROMPTS[0], 8)  # the pool goes on with the survivor
        assert again["token_ids"] == refs[0]["token_ids"][:8] and router.instances()[survivor]["healthy"]

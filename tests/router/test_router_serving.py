"""The router over three real `kvflow serve` instances (tiny checkpoint): it answers as one instance would, each
policy places as it says, and an instance that joins at runtime is used at once."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import httpx
import openai
import pytest

from kvflow.api.server import APIConfig
from kvflow.router.config import RouterConfig
from kvflow.router.roles import BalanceConfig
from kvflow.router.policies import RouteRequest
from router_helpers import (BLOCK, MODEL, RouterThread, complete, free_port, metric, serve_instance, start_instances,
                            stop_all, tiny_long_ckpt, until, wait_healthy)  # noqa: F401  (a fixture)

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def tokens(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny vocabulary (5..95: no special tokens), the same for the same seed."""
    return random.Random(seed).choices(range(5, 96), k=n)


@pytest.fixture(scope="module")
def instances(tiny_long_ckpt):
    procs = start_instances(tiny_long_ckpt, 3)
    yield procs
    stop_all(procs)


def config(instances, policy: str, **kw) -> RouterConfig:
    return RouterConfig(instances=tuple(p.url for p in instances), policy=policy, block_tokens=BLOCK,
                        health_interval_s=0.2, **kw)


def test_router_answers_as_one_instance(instances, tiny_long_ckpt):
    direct = complete(instances[0].url, PROMPT, 12)
    with RouterThread(config(instances, "round_robin"), tiny_long_ckpt, APIConfig(api_key="k3y")) as router:
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT}).status_code == 401
        assert httpx.get(f"{router.url}/health").json() == {"status": "ok"}  # open path
        models = httpx.get(f"{router.url}/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 1024)]
        c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="k3y", max_retries=0)
        for _ in range(3):  # one on each instance: every one answers the same
            r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == direct["token_ids"] and r.choices[0].text == direct["text"]
            assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        assert sorted(router.routed().values()) == [1, 1, 1]
        stream = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == direct["text"]
        # chat: templated and tokenized by the router, the same text as the instance's own chat endpoint
        msg = [{"role": "user", "content": "w9 w10 w11"}]
        mine = c.chat.completions.create(model=MODEL, messages=msg, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        theirs = httpx.post(f"{instances[1].url}/v1/chat/completions", timeout=60,
                            json={"model": MODEL, "messages": msg, "max_tokens": 6, "temperature": 0,
                                  "ignore_eos": True}).json()
        assert mine.choices[0].message.content == theirs["choices"][0]["message"]["content"]
        assert mine.usage.prompt_tokens == theirs["usage"]["prompt_tokens"]
        # stop strings and max_tokens are the router's own checks too: the answer ends where the instance's would
        words = direct["text"].split()
        stopped = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[words[3]],
                                       extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == direct["text"][:direct["text"].index(words[3])]
        assert stopped.choices[0].finish_reason == "stop"
        # errors are the API's: the router validates before any instance sees the request
        bad = httpx.post(f"{router.url}/v1/completions", headers=auth,
                         json={"model": MODEL, "prompt": [5] * 1020, "max_tokens": 10})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
        up = metric(router.url, "kvflow_router_instance_up")
        assert up == {(p.url,): 1.0 for p in instances}
        assert sum(metric(router.url, "kvflow_router_routed_total").values()) == 6  # the 400 reached none


def _hits(url: str) -> float:
    return sum(v for k, v in metric(url, "kvflow_prefix_cache_hits_total").items() if "device" in k)


def test_prefix_aware_keeps_a_shared_prefix_on_one_instance(instances, tiny_long_ckpt):
    shared = tokens(1, 8 * BLOCK)  # 8 blocks every request shares, then its own 2 blocks
    prompts = [shared + tokens(100 + i, 2 * BLOCK) for i in range(6)]
    before = {p.url: _hits(p.url) for p in instances}
    with RouterThread(config(instances, "prefix_aware"), tiny_long_ckpt) as router:
        for prompt in prompts:
            complete(router.url, prompt, 2)
        routed = router.routed()
    assert sorted(routed.values()) == [0, 0, 6]  # 8 of 10 blocks cached there (> 0.5): every request follows them
    holder = max(routed, key=routed.get)
    gained = {p.url: _hits(p.url) - before[p.url] for p in instances}
    assert gained[holder] >= 5 * len(shared) and sum(gained.values()) == gained[holder]


def test_round_robin_spreads_the_same_prefix(instances, tiny_long_ckpt):
    shared = tokens(2, 8 * BLOCK)
    with RouterThread(config(instances, "round_robin"), tiny_long_ckpt) as router:
        for i in range(6):
            complete(router.url, shared + tokens(200 + i, BLOCK), 2)
        assert sorted(router.routed().values()) == [2, 2, 2]


@pytest.mark.parametrize("policy", ["least_load", "length_aware"])
def test_load_policies_avoid_busy_instances(instances, tiny_long_ckpt, policy):
    """Two instances hold open requests (flights opened in the pool as the router opens them for a request: a
    stream held open by a client would finish on its own, the tiny model is too fast); the next requests go to the
    third, and to the less loaded of the busy ones once it is busier than them."""
    with RouterThread(config(instances, policy), tiny_long_ckpt) as router:
        pool = router.backend.pool
        a, b, c = (pool.instances[p.url] for p in instances)
        long = RouteRequest(20, predicted_output=400.0)
        router.on_loop(lambda: [pool.open(a, long), pool.open(b, long), pool.open(b, long)])
        for i in range(3):  # one after another, each done before the next: c stays the least loaded
            complete(router.url, tokens(300 + i, 10), 3)
        assert router.routed() == {a.url: 1, b.url: 2, c.url: 3}
        flights = router.on_loop(lambda: [pool.open(c, long) for _ in range(3)])  # c busiest now
        complete(router.url, tokens(400, 10), 3)
        assert router.routed() == {a.url: 2, b.url: 2, c.url: 6}
        router.on_loop(lambda: [pool.close(c, f) for f in flights])


def test_an_instance_that_joins_is_used_at_once(instances, tiny_long_ckpt):
    newcomer = serve_instance(tiny_long_ckpt)
    try:
        with RouterThread(config(instances[:1], "round_robin"), tiny_long_ckpt) as router:
            complete(router.url, PROMPT, 2)
            newcomer.wait_ready()
            r = httpx.post(f"{router.url}/router/instances", json={"url": newcomer.url}, timeout=30)
            assert r.status_code == 200 and r.json() == {"url": newcomer.url, "role": "mixed", "healthy": True}
            complete(router.url, PROMPT, 2)  # the next turn is the newcomer's
            assert router.routed() == {instances[0].url: 1, newcomer.url: 1}
            # an instance that is not up, or serves another model, is refused
            r = httpx.post(f"{router.url}/router/instances", json={"url": "http://127.0.0.1:9"}, timeout=30)
            assert r.status_code == 400 and "did not answer" in r.json()["error"]["message"]
            # leaving: no more requests go there
            assert httpx.request("DELETE", f"{router.url}/router/instances", json={"url": newcomer.url}).status_code == 200
            for _ in range(2):
                complete(router.url, PROMPT, 2)
            assert router.routed() == {instances[0].url: 3}
    finally:
        newcomer.stop()


def test_pd_pools_pull_the_prompt_kv_and_answer_as_one_instance(instances, tiny_long_ckpt):
    """P/D pools: the prompt on the prefill instance, the rest on the decode instance, which pulls the prompt's full
    blocks from it (and computes only the rest): the same tokens as one instance. A role flip drains first."""
    prefill, decode, alone = instances
    prompts = [tokens(200 + i, 5 * BLOCK + 3) for i in range(3)]
    want = [complete(alone.url, p, 10)["token_ids"] for p in prompts]
    pulled = metric(decode.url, "kvflow_kv_pulled_blocks_total")[()]
    cfg = RouterConfig(prefill=(prefill.url,), decode=(decode.url,), block_tokens=BLOCK, health_interval_s=0.2)
    with RouterThread(cfg, tiny_long_ckpt) as router:
        got = [complete(router.url, p, 10)["token_ids"] for p in prompts]
        c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        stream = c.completions.create(model=MODEL, prompt=tokens(300, 5 * BLOCK + 3), max_tokens=10, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert streamed == complete(alone.url, tokens(300, 5 * BLOCK + 3), 10)["text"]
        assert router.routed() == {prefill.url: 4, decode.url: 4}
        assert metric(router.url, "kvflow_router_handoffs_total")[()] == 4
        # a one-token request is all prompt: it stays on the prefill instance
        assert complete(router.url, tokens(400, 20), 1)["finish_reason"] == "length"
        assert router.routed() == {prefill.url: 5, decode.url: 4}
        # the prefill instance turns decode: no prefill pool left, so whole requests go to the decode pool
        r = httpx.post(f"{router.url}/router/instances/role", json={"url": prefill.url, "role": "decode"})
        assert r.status_code == 200 and r.json() == {"url": prefill.url, "role": "decode", "next_role": None}
        assert router.instances()[prefill.url]["role"] == "decode"
        complete(router.url, prompts[0], 10)
        complete(router.url, prompts[0], 10)
        assert sum(router.routed().values()) == 11 and metric(router.url, "kvflow_router_handoffs_total")[()] == 4
        bad = httpx.post(f"{router.url}/router/instances/role", json={"url": prefill.url, "role": "boss"})
        assert bad.status_code == 400
        assert httpx.post(f"{router.url}/router/instances/role",
                          json={"url": "http://127.0.0.1:9", "role": "decode"}).status_code == 404
    assert got == want
    # every full block of the four prompts (5 each) came from the prefill instance, none was missing
    assert metric(decode.url, "kvflow_kv_pulled_blocks_total")[()] - pulled == 4 * 5
    assert metric(decode.url, "kvflow_kv_pull_missed_blocks_total")[()] == 0


def test_rebalancing_moves_a_decode_instance_to_the_prefill_pool_missing_its_ttft(instances, tiny_long_ckpt):
    """`RouterBackend.balance`: requests through both pools miss a (tiny) TTFT target and meet the TPOT one, so one of
    the two decode instances joins the prefill pool; the decode pool keeps its last."""
    a, b, c = instances
    cfg = RouterConfig(prefill=(a.url,), decode=(b.url, c.url), block_tokens=BLOCK, health_interval_s=0.2)
    with RouterThread(cfg, tiny_long_ckpt) as router:
        router.on_loop(lambda: router.backend.balance(BalanceConfig(ttft_slo_s=1e-4, tpot_slo_s=100.0, interval_s=0.1,
                                                                    after=2, min_requests=2)))
        for i in range(3):
            complete(router.url, tokens(500 + i, 2 * BLOCK + 1), 4)
        until(lambda: router.backend.balancer.moves)
        (moved, role), = router.backend.balancer.moves
        assert role == "prefill" and moved in (b.url, c.url)
        roles = {u: i["role"] for u, i in router.instances().items()}
        assert sorted(roles.values()) == ["decode", "prefill", "prefill"]
        assert complete(router.url, tokens(600, 2 * BLOCK + 1), 4)["finish_reason"] == "length"


def test_kvflow_router_command(instances, tiny_long_ckpt, tmp_path):
    """`kvflow router` as a process: instances from --config and --instance, the API key, SIGTERM exits 0."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"instances: [{instances[0].url}]\npolicy: least_load\nblock_tokens: {BLOCK}\n")
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli.main", "router", "--config", str(cfg), "--instance", instances[1].url,
           "--policy", "round_robin", "--model", str(tiny_long_ckpt), "--port", str(port), "--api-key", "s3cret",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/router/instances").status_code == 401
        listed = httpx.get(f"{url}/router/instances", headers=auth).json()
        assert listed["policy"] == "round_robin" and [i["url"] for i in listed["instances"]] == [p.url for p in instances[:2]]
        r = httpx.post(f"{url}/v1/completions", headers=auth, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert "Traceback" not in proc.stdout.read().decode()

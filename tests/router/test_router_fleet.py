"""Instances the router starts itself (`kvflow.router.fleet`, `kvflow router --launch N`): real `kvflow serve`
processes on free ports; one that is SIGKILLed is started again on its port and rejoins the pool; one that cannot
start is given up instead of restarted in a loop; none outlives the router."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

from kvflow.router.backend import RouterBackend
from kvflow.router.config import RouterConfig
from kvflow.router.fleet import FleetConfig, LocalFleet, LocalInstance
from router_helpers import BLOCK, RouterThread, complete, instance_args, tiny_long_ckpt, until  # noqa: F401

PROMPTS = [random.Random(40 + i).choices(range(5, 96), k=24) for i in range(4)]



def _serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_router_starts_its_instances_and_starts_a_killed_one_again(tiny_long_ckpt):
    fleet = LocalFleet(FleetConfig(2, instance_args(tiny_long_ckpt)))
    urls = fleet.start()
    try:
        cfg = RouterConfig(instances=tuple(urls), policy="round_robin", block_tokens=BLOCK, health_interval_s=0.2)
        router = RouterThread(cfg, tiny_long_ckpt, fleet=fleet, wait_s=180)
    except BaseException:
        fleet.close()
        raise
    with router:
        until(lambda: all(i["healthy"] for i in router.instances().values()) and len(router.instances()) == 2)
        refs = [complete(router.url, p, 12)["token_ids"] for p in PROMPTS]  # round robin: both instances answer
        assert set(router.routed().values()) == {2}
        victim = fleet.instances[0]
        old = victim.proc
        old.send_signal(signal.SIGKILL)
        until(lambda: victim.starts == 2 and victim.proc.pid != old.pid)  # started again, on its port
        assert old.wait(10) == -signal.SIGKILL and victim.url == urls[0]
        until(lambda: _serving(victim.url) and router.instances()[victim.url]["healthy"])
        before = router.routed()[victim.url]
        again = [complete(router.url, p, 12)["token_ids"] for p in PROMPTS]
        assert again == refs and router.routed()[victim.url] == before + 2  # it serves again, the same tokens
    assert all(i.proc.poll() is not None for i in fleet.instances)  # the router's shutdown stopped them


def test_an_instance_that_cannot_start_is_given_up_with_its_log(tiny_long_ckpt):
    fleet = LocalFleet(FleetConfig(1, ("--threads", "-1"), max_restarts=1))
    urls = fleet.start()
    try:
        with pytest.raises(ValueError, match="every instance the router started exited") as e:
            asyncio.run(RouterBackend.connect(RouterConfig(instances=tuple(urls)), str(tiny_long_ckpt), wait_s=120,
                                              fleet=fleet))
    finally:
        fleet.close()
    (inst,) = fleet.instances
    assert inst.given_up and inst.starts == 2  # started, started again once, then given up
    assert "--threads" in str(e.value)  # the instance's own error, from its log


@pytest.mark.parametrize("bad", [{"count": 0}, {"serve_args": ("--port", "9000")}, {"serve_args": ("--host=0.0.0.0",)},
                                 {"max_restarts": -1}])
def test_fleet_config_rejects_what_is_not_its_users_to_choose(bad):
    with pytest.raises(ValueError):
        FleetConfig(**{"count": 1, **bad})


def test_each_instance_sees_one_gpu_in_turn_and_keeps_it(tmp_path):
    fleet = LocalFleet(FleetConfig(3, gpus=("0", "1"), log_dir=str(tmp_path)))
    insts = [LocalInstance(i, 9000 + i, f"http://127.0.0.1:{9000 + i}", tmp_path / f"instance-{i}.log") for i in range(3)]
    assert [fleet.env(i)["CUDA_VISIBLE_DEVICES"] for i in insts] == ["0", "1", "0"]
    assert LocalFleet(FleetConfig(1, log_dir=str(tmp_path))).env(insts[0]) == dict(os.environ)  # one GPU or none: as is


def test_kvflow_router_launches_pd_pools(tiny_long_ckpt):
    """`kvflow router --launch-pd 1:1`: a prefill and a decode instance of its own (a host tier added for the pulled
    KV), a request through both, the decode side pulling the prompt's blocks; SIGTERM stops them all."""
    import subprocess
    import sys

    from router_helpers import free_port, metric, wait_healthy

    args = list(instance_args(tiny_long_ckpt))
    i = args.index("--host-kv-bytes")
    del args[i:i + 2]  # the router adds one
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli.main", "router", "--launch-pd", "1:1", "--serve-args",
                             " ".join(args), "--model", str(tiny_long_ckpt), "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(proc, url)
        until(lambda: len(httpx.get(f"{url}/router/instances").json()["instances"]) == 2
              and all(i["healthy"] for i in httpx.get(f"{url}/router/instances").json()["instances"]))
        roles = {i["role"]: i["url"] for i in httpx.get(f"{url}/router/instances").json()["instances"]}
        assert set(roles) == {"prefill", "decode"}
        prompt = random.Random(7).choices(range(5, 96), k=3 * BLOCK + 2)
        assert complete(url, prompt, 6)["token_ids"] == complete(roles["prefill"], prompt, 6)["token_ids"]
        assert metric(url, "kvflow_router_handoffs_total")[()] == 1
        assert metric(roles["decode"], "kvflow_kv_pulled_blocks_total")[()] == 3
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    out = proc.stdout.read().decode()
    assert "Traceback" not in out and "prefill http://" in out
    assert not any(_serving(u) for u in roles.values())

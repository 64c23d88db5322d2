"""The router's own instances on a Ray cluster (`kvflow.router.ray_fleet`): a real `kvflow serve` started by a Ray actor
on a node of a `ray.cluster_utils.Cluster` on this machine (conftest's `ray_cluster`), serving through the router; its process SIGKILLed, it is
started again at the same URL; its actor killed, a new actor starts it at a new URL, which the pool follows; the
router's shutdown stops it."""

from __future__ import annotations

import os
import random
import signal

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the Ray fleet needs ray (pip install 'kvflow[ray]')")

from kvflow.router.config import RouterConfig  # noqa: E402
from kvflow.router.fleet import FleetConfig  # noqa: E402
from kvflow.router.ray_fleet import RayFleet  # noqa: E402
from router_helpers import BLOCK, RouterThread, complete, instance_args, tiny_long_ckpt, until  # noqa: E402,F401

PROMPT = random.Random(5).choices(range(5, 96), k=20)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_ray_fleet_serves_restarts_and_moves_its_instance(ray_cluster, tiny_long_ckpt):
    fleet = RayFleet(FleetConfig(1, instance_args(tiny_long_ckpt)), ray_cluster[0].address)
    first, = fleet.start()
    try:
        router = RouterThread(RouterConfig(instances=(first,), block_tokens=BLOCK, health_interval_s=0.2), tiny_long_ckpt,
                              fleet=fleet, wait_s=240)
    except BaseException:
        fleet.close()
        raise
    with router:
        until(lambda: router.instances()[first]["healthy"])
        want = complete(router.url, PROMPT, 8)["token_ids"]
        inst = fleet.instances[0]
        # the process dies: its actor starts it again, same URL
        pid = ray.get(fleet.actors[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        until(lambda: inst.starts == 2 and _up(first) and router.instances().get(first, {}).get("healthy"))
        assert complete(router.url, PROMPT, 8)["token_ids"] == want
        # the actor dies: a new actor starts it at a new URL, and the pool follows
        ray.kill(fleet.actors[0])
        until(lambda: inst.url != first and inst.url in router.instances() and router.instances()[inst.url]["healthy"])
        assert first not in router.instances() and inst.starts == 3
        assert complete(router.url, PROMPT, 8)["token_ids"] == want
        assert "--- start" in fleet.tail(inst)
        last = inst.url
    assert not _up(last)  # the router's shutdown stopped it

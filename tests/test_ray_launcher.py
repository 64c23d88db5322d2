"""The Ray launcher on a real multi-node Ray cluster on this machine (conftest's `ray_cluster`, a
`ray.cluster_utils.Cluster`: a head without CPUs and two worker nodes, `node_a` and `node_b`, each
offering one CPU and its own custom resource): the stages run as actors on different Ray nodes, give the engine's tokens, stream
KV over kvflow's own transports between them, and a killed actor is detected and replaced."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray", reason="the Ray launcher tests need ray (pip install 'kvflow[ray]')")

from kvflow.config import ClusterConfig, EngineConfig  # noqa: E402
from kvflow.controller.controller import Controller  # noqa: E402
from kvflow.controller.ray_launcher import Placement, RayConfig, RayLauncher, RayWorkerHandle, StagePlacement  # noqa: E402
from kvflow.sched.sampling import SamplingParams  # noqa: E402

from conftest import on_loop_thread, run_to_completion, tiny_engine  # noqa: E402
from servers import ServeProcess  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 70)), [11, 12]]
LENGTHS = [12, 3, 9, 1, 6, 10]
def reference(prompts, lengths):
    eng = tiny_engine(num_kv_blocks=256, block_size=4)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    final = run_to_completion(eng)
    return [final[r.request_id].token_ids for r in reqs]


def _cfg(tiny_ckpt_dir, **kw) -> ClusterConfig:
    base = dict(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=128, block_size=4), microbatch_size=2,
                prompt_microbatch_size=2, heartbeat_timeout_s=30.0, host=ray.util.get_node_ip_address())
    base.update(kw)
    return ClusterConfig(**base)


async def _collect(ctrl, prompt, params, rid):
    toks, last = [], None
    async for out in ctrl.generate(prompt, params, rid):
        toks += out.new_token_ids
        last = out
    return toks, last


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kw, plan, expect", [
    (dict(mode="colocated", depth=2), lambda ids: Placement({"colocated-0": StagePlacement(node_id=ids["node_b"]),
                                                              "colocated-1": StagePlacement(node_id=ids["node_a"])}),
     {"colocated-0": "node_b", "colocated-1": "node_a"}),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1),
     lambda ids: Placement({"prompt-0": StagePlacement(resources={"node_a": 0.01})}, strategy="STRICT_SPREAD"),
     {"prompt-0": "node_a", "token-0": "node_b"}),
], ids=["colocated-2:by-node-id", "disagg-1-1:by-resource"])
def test_stages_run_as_actors_on_their_nodes_and_give_the_engine_tokens(ray_cluster, tiny_ckpt_dir, kw, plan, expect):
    _, node_ids = ray_cluster
    cfg = _cfg(tiny_ckpt_dir, **kw)
    launcher = RayLauncher(cfg, RayConfig(placement=plan(node_ids)))

    async def main():
        ctrl = Controller(cfg, launcher=launcher)
        await ctrl.start()
        try:
            results = await asyncio.gather(*[_collect(ctrl, p, _greedy(n), f"r{i}") for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))])
            where = {name: s.process.where for name, s in ctrl.stages.items()}
            addrs = {name: (s.step_addr, s.kv_addr) for name, s in ctrl.stages.items()}
            # the prompt worker reports the KV bytes it streamed with its heartbeats: wait for a report (an event)
            deadline = time.monotonic() + 60
            while kw["mode"] == "disaggregated" and ctrl.stats().kv_bytes_streamed_total == 0:
                assert time.monotonic() < deadline, "no KV bytes reported"
                await asyncio.sleep(0.05)
            return results, where, addrs, ctrl.stats(), [p.kv_manager.num_free_blocks for p in ctrl.pipelines]
        finally:
            await ctrl.shutdown()
            launcher.close()

    results, where, addrs, stats, free = asyncio.run(main())
    assert [t for t, _ in results] == reference(PROMPTS, LENGTHS)
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    assert {name: w.node_id for name, w in where.items()} == {name: node_ids[r] for name, r in expect.items()}
    assert len({w.pid for w in where.values()}) == len(where) and os.getpid() not in {w.pid for w in where.values()}
    for name, (step_addr, kv_addr) in addrs.items():  # our transports, at the addresses the actors bound
        assert step_addr.startswith(f"tcp://{where[name].node_ip}:")
        assert kv_addr == "" or kv_addr.startswith(f"tcp://{where[name].node_ip}:")
    if kw["mode"] == "disaggregated":
        assert stats.kv_bytes_streamed_total > 0
    assert free == [128] * len(free), "KV blocks leaked"


PROMPTS_FT = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]
LENGTHS_FT = [40, 25, 60, 35]


@pytest.mark.parametrize("kw, victim, how", [
    (dict(mode="colocated", depth=2), "colocated-1", "sigkill"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0", "ray.kill"),
    (dict(mode="colocated", depth=2, heartbeat_timeout_s=2.0), "colocated-0", "sigstop"),
], ids=["colocated-2:sigkill-the-actor-process", "disagg-1-1:ray.kill-the-token-actor", "colocated-2:hung-actor-fenced"])
def test_a_killed_actor_is_detected_and_replaced_by_the_launcher(ray_cluster, tiny_ckpt_dir, caplog, kw, victim, how):
    """The handle's poll() reports the actor's death (the heartbeat timeout is far beyond the test's
    own deadlines, so it cannot be what detects it); a hung actor (SIGSTOP) is found by its missing
    heartbeats and fenced with `ray.kill`. With replication on (the default ring; depth 1: the
    controller's store), the lost stage's requests resume from the replica; every stream is the
    engine's, and the replacement is a new actor in the same bundle (same node)."""
    caplog.set_level(logging.WARNING, logger="kvflow.controller.controller")
    cfg = _cfg(tiny_ckpt_dir, microbatch_size=4, **{"heartbeat_timeout_s": 600.0, **kw})
    launcher = RayLauncher(cfg, RayConfig(strategy="STRICT_SPREAD"))

    async def main():
        ctrl = Controller(cfg, launcher=launcher)
        await ctrl.start()
        s = ctrl.stages[victim]
        pipe = next(q for q in ctrl.pipelines if s in q.stages)
        before = s.process
        assert isinstance(before, RayWorkerHandle)
        old = before.where

        def due() -> bool:  # 20 tokens are out and the victim's replica holds KV of every request it runs
            return ctrl.generated >= 20 and bool(pipe.sched.running) and all(
                pipe.watermark.get(s.stage, {}).get(r.request_id, 0) > 0 for r in pipe.sched.running)

        def strike() -> None:
            if how == "sigkill":
                os.kill(old.pid, signal.SIGKILL)
            elif how == "sigstop":
                os.kill(old.pid, signal.SIGSTOP)  # hung: alive to Ray, silent to the controller
            else:
                ray.kill(before.actor)

        fired = on_loop_thread(ctrl, (due, strike))  # on the controller's thread: requests are mid-generation
        tasks = [asyncio.ensure_future(_collect(ctrl, p, _greedy(n), f"r{i}"))
                 for i, (p, n) in enumerate(zip(PROMPTS_FT, LENGTHS_FT))]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            assert fired, "the failure was meant to strike while requests were running"
            deadline = time.monotonic() + 120
            while ctrl.recovery.recoveries < 1 and ctrl.failure is None:
                assert time.monotonic() < deadline, "no recovery after 120 s"
                await asyncio.sleep(0.01)
            new = ctrl.stages[victim].process.where
            return results, before, old, new, (ctrl.recovery.failures, ctrl.recovery.recoveries, ctrl.recovery.resumed, ctrl.healthy())
        finally:
            await ctrl.shutdown()
            launcher.close()

    results, before, old, new, (failures, recoveries, resumed, healthy) = asyncio.run(main())
    assert [t for t, _ in results] == reference(PROMPTS_FT, LENGTHS_FT)
    assert before.poll() == 1 and before.error.startswith("Ray actor died")  # the dead actor, as its handle saw it
    detected = "stopped sending heartbeats" if how == "sigstop" else "died (exit code 1); recovering"
    assert any(f"worker {victim}" in r.getMessage() and detected in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert failures == 1 and recoveries == 1 and healthy
    assert resumed > 0, "the lost stage's requests were meant to resume from its replica"
    assert new.pid != old.pid and new.node_id == old.node_id  # a new actor, in the same bundle


def _until_available(cpu: float, node_a: float, node_b: float, timeout: float = 60) -> None:
    """Wait until the cluster reports these resources available (its reports lag by up to ~1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = ray.available_resources()
        if (got.get("CPU", 0.0), got.get("node_a", 0.0), got.get("node_b", 0.0)) == (cpu, node_a, node_b):
            return
        assert time.monotonic() < deadline, f"available {got}, expected CPU {cpu}, node_a {node_a}, node_b {node_b}"
        time.sleep(0.1)


def test_kvflow_serve_launcher_ray_with_a_plan_file(ray_cluster, tiny_ckpt_dir, tmp_path):
    """The CLI end to end: `kvflow serve --launcher ray --ray-address ... --plan FILE` joins the
    cluster as a driver of its own, reserves the planned bundles (each stage's CPU and its node's
    resource), serves the engine's tokens, and gives everything back when it stops."""
    import httpx

    c, _ = ray_cluster
    prompt, n = [3, 30, 31, 4], 6
    eng = tiny_engine(num_kv_blocks=128, block_size=4)
    ref = eng.add_request(prompt, _greedy(n))
    expected = run_to_completion(eng)[ref.request_id].token_ids
    assert all(t >= 5 for t in expected), "the comparison below reads token ids back from words w<id>"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(Placement({"colocated-0": StagePlacement(resources={"node_b": 0.25}),
                                          "colocated-1": StagePlacement(resources={"node_a": 0.25})}).to_dict()))
    _until_available(2.0, 1.0, 1.0)  # the other tests' placement groups are gone
    with ServeProcess("serve", "--model", str(tiny_ckpt_dir), "--served-model-name", "tiny", "--mode", "colocated",
                      "--depth", "2", "--threads", "1", "--kv-cache-gb", "0.01", "--launcher", "ray", "--ray-address",
                      c.address, "--placement-strategy", "STRICT_SPREAD", "--plan", str(plan), "--log-level", "warning") as srv:
        srv.wait_ready(180)
        # each stage's bundle: one CPU and a quarter of its planned node's resource
        _until_available(0.0, 0.75, 0.75)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert srv.stop() == 0, srv.log
    assert r.json()["choices"][0]["text"].split() == [f"w{t}" for t in expected]
    assert "Ray placement group (STRICT_SPREAD)" in srv.log, srv.log
    _until_available(2.0, 1.0, 1.0)  # the placement group was released

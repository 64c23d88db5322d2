"""Recovery from a worker's death or hang (real SIGKILL / SIGSTOP of real processes): the lost worker
is fenced and replaced, every request that lost KV is recomputed, and clients see only a delay."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import time

import pytest
import torch

from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.controller import Controller
from kvflow.controller.launcher import SubprocessLauncher
from kvflow.controller.replica_store import ReplicaStore
from kvflow.sched.sampling import SamplingParams

from conftest import controller_state, on_loop_thread, run_to_completion, tiny_config, tiny_engine

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 70)), [11, 12]]
LENGTHS = [40, 25, 60, 35, 50, 45]
SEEDED = {1: 11, 4: 29}  # these two sample (temperature 0.8) with a seed: reproducible across a failure


def params(i: int) -> SamplingParams:
    if i in SEEDED:
        return SamplingParams(max_tokens=LENGTHS[i], temperature=0.8, seed=SEEDED[i], ignore_eos=True)
    return SamplingParams(max_tokens=LENGTHS[i], temperature=0, ignore_eos=True)


@functools.cache
def reference(num_layers: int = 2) -> list[list[int]]:
    """The engine's tokens for PROMPTS (computed once per layer count; callers only compare with them)."""
    eng = tiny_engine(tiny_config(num_layers=num_layers), num_kv_blocks=256, block_size=4)
    reqs = [eng.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    final = run_to_completion(eng)
    return [final[r.request_id].token_ids for r in reqs]


counters: dict = {}


async def recovered(ctrl: Controller, n: int) -> None:
    """Wait for the controller's n-th recovery (an event, not a timer). A killed worker that the
    remaining requests no longer need (a prompt worker once every prompt is through) can be
    detected after they finish; the test must not end before its recovery does."""
    deadline = time.monotonic() + 120
    while ctrl.recovery.recoveries < n and ctrl.failure is None:
        assert time.monotonic() < deadline, f"{ctrl.recovery.recoveries} of {n} recoveries after 120 s"
        await asyncio.sleep(0.01)


def run_with_failure(cfg: ClusterConfig, victim_name: str | None, how: str, after_tokens: int, replicated: bool = False,
                     rig=None):
    """Stream all requests; once `after_tokens` tokens have been streamed in all (and, if
    `replicated`, the victim's replica holds some KV of every request it runs), SIGKILL (or SIGSTOP
    for longer than the heartbeat timeout) `victim_name` (None: a random worker), after `rig(victim's
    StageHandle)` if given. Returns each request's streamed token list, final output and the
    controller's counters."""

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        streamed = [[] for _ in PROMPTS]
        finals = [None] * len(PROMPTS)
        counters.clear()

        async def one(i):
            async for out in ctrl.generate(PROMPTS[i], params(i), f"r{i}"):
                streamed[i] += out.new_token_ids
                finals[i] = out

        name = victim_name or random.Random(len(cfg.pipelines())).choice(sorted(ctrl.stages))
        s = ctrl.stages[name]
        p = next(p for p in ctrl.pipelines if s in p.stages)
        stopped = None

        def due() -> bool:  # enough tokens sampled; replicated: the victim's replica holds KV of all it runs
            return ctrl.generated >= after_tokens and (not replicated or bool(p.sched.running) and all(
                p.watermark.get(s.stage, {}).get(r.request_id, 0) > 0 for r in p.sched.running))

        def strike() -> None:
            nonlocal stopped
            # requests with a decode-ahead batch in flight (voided by the failure), where the victim's pipeline decodes ahead
            counters.update(ahead=len(p.sched.ahead), decodes_ahead=p.sched.config.decode_ahead)
            if rig is not None:
                rig(s)
            os.kill(s.process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            if how != "kill":
                stopped = s.process

        fired = on_loop_thread(ctrl, (due, strike))
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
        try:
            done, pending = await asyncio.wait(tasks, timeout=150)  # (seconds a run takes; a hang says where it stood)
            for t in pending:
                t.cancel()
            assert not pending, f"streams still open after 150 s:\n{controller_state(ctrl)}"
            for t in done:
                t.result()
            assert fired, "the failure was meant to strike while requests were running"
            await recovered(ctrl, 1)
            counters.update(failures=ctrl.recovery.failures, recoveries=ctrl.recovery.recoveries, resumed=ctrl.recovery.resumed,
                            lost=ctrl.recovery.lost_tokens, recomputed=ctrl.recovery.recomputed_tokens,
                            store_port_bytes=ctrl.store.nbytes if ctrl.store is not None else None,
                            held_in_shm=[s.replica_shm for s in p.stages], small_paths=list(ctrl.stages[name].small_paths))
            return streamed, finals, (ctrl.recovery.failures, ctrl.recovery.recoveries, ctrl.healthy())
        finally:
            if stopped is not None and stopped.poll() is None:
                os.kill(stopped.pid, signal.SIGCONT)  # fenced already; make sure nothing lingers
            await ctrl.shutdown()

    return asyncio.run(main())


def _cfg(tiny_ckpt_dir, **kw) -> ClusterConfig:
    base = dict(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=128, block_size=4), microbatch_size=4,
                prompt_microbatch_size=2, heartbeat_timeout_s=30.0)
    base.update(kw)
    return ClusterConfig(**base)


@pytest.mark.parametrize("kw, victim", [
    (dict(mode="colocated", depth=2, replication="none"), "colocated-1"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=2), "prompt-0"),
    (dict(mode="disaggregated", prompt_depth=2, token_depth=2), None),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1, replication="none"), "token-0"),
    (dict(mode="colocated", depth=1, replication="none"), "colocated-0"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1, decode_ahead=False), "token-0"),
], ids=["colocated-2:stage1:no-replica", "disagg-1-1:token", "disagg-1-2:prompt", "disagg-2-2:random",
        "disagg-1-1:token:no-replica", "colocated-1:no-replica", "disagg-1-1:token:serial"])
def test_a_killed_worker_is_replaced_and_every_request_completes_unchanged(tiny_ckpt_dir, kw, victim):
    expected = reference()
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(_cfg(tiny_ckpt_dir, **kw), victim, "kill", 20)
    assert failures == 1 and recoveries == 1 and healthy
    assert counters["ahead"] > 0 if counters["decodes_ahead"] else counters["ahead"] == 0
    assert all(f.finished and f.finish_reason == "length" for f in finals)
    assert streamed == expected  # no token lost, none duplicated, greedy and seeded alike
    assert [f.token_ids for f in finals] == expected


@pytest.mark.parametrize("kw, victim", [
    (dict(mode="colocated", depth=2), "colocated-1"),
    (dict(mode="colocated", depth=3), "colocated-1"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=2), "token-0"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0"),
    (dict(mode="colocated", depth=2, replication="store"), "colocated-0"),
    (dict(mode="colocated", depth=1), "colocated-0"),
    (dict(mode="disaggregated", prompt_depth=1, token_depth=1, decode_ahead=False), "token-0"),
    (dict(mode="colocated", depth=2, decode_ahead_depth=2), "colocated-1"),
], ids=["colocated-2", "colocated-3", "disagg-1-2:token", "disagg-1-1:token:store", "colocated-2:store",
        "colocated-1:store", "disagg-1-1:token:store:serial", "colocated-2:ahead"])
def test_a_killed_worker_resumes_from_its_replica(tiny_ckpt_dir, tiny4_ckpt_dir, kw, victim):
    """Ring replication (or, depth 1 or when asked, the controller's host store): the requests of the
    lost stage resume from the replica's watermark and recompute only the tokens after it (not
    everything), with the same streamed tokens."""
    deep = kw.get("depth", 0) > 2
    expected = reference(4 if deep else 2)
    cfg = _cfg(tiny4_ckpt_dir if deep else tiny_ckpt_dir, **kw)
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, victim, "kill", 20, replicated=True)
    assert failures == 1 and recoveries == 1 and healthy
    assert counters["resumed"] > 0
    assert counters["recomputed"] < counters["lost"], counters
    assert counters["ahead"] > 0 if counters["decodes_ahead"] else counters["ahead"] == 0
    assert streamed == expected and [f.token_ids for f in finals] == expected
    if cfg.replicates(cfg.pipelines()[-1]) == "store":  # local workers write the store's shared memory in place
        assert counters["store_port_bytes"] == 0
    else:  # ring: each holder keeps the replica in the controller's shared memory, written in place
        assert all(counters["held_in_shm"]), counters


@pytest.mark.parametrize("kw, victim", [(dict(mode="colocated", depth=2), "colocated-1"),
                                        (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0")],
                         ids=["colocated-2", "disagg-1-1:token:store"])
def test_replicas_landed_by_a_thread_resume_alike(tiny_ckpt_dir, tiny4_ckpt_dir, kw, victim, monkeypatch):
    """The CUDA way of writing replicas in place (the step only packs; a thread of the worker writes
    the segment and reports, and a fence waits for it), on the CPU: the same recovery, the same tokens."""
    monkeypatch.setenv("KVFLOW_TEST_REPLICATION_THREAD", "1")
    test_a_killed_worker_resumes_from_its_replica(tiny_ckpt_dir, tiny4_ckpt_dir, kw, victim)


def test_a_replacement_adopts_the_linear_paths_its_predecessor_chose(tiny_ckpt_dir):
    """A replacement does not measure its CPU linear paths again (seconds of a recovery on a real
    model): its Setup carries what its predecessor reported in `Ready`, and it reports that back.
    The predecessor's report is replaced just before the kill by a choice no measurement here makes
    (the paths alternating row by row), so only a replacement that adopted it can report it."""
    from kvflow.model import linear

    paths = [p for p in linear.small_paths(torch.float32) if p in ("plain", "prepacked")]
    if len(paths) < 2:
        pytest.skip("one CPU linear path here: nothing to choose")
    alternating = [paths[r % 2] for r in range(linear.SMALL_ROWS[-1])]
    seen = []

    def rig(victim) -> None:
        seen.append(list(victim.small_paths))  # (what the predecessor measured and reported)
        victim.small_paths = alternating

    cfg = _cfg(tiny_ckpt_dir, mode="colocated", depth=2)
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, "colocated-1", "kill", 20, rig=rig)
    assert failures == 1 and recoveries == 1 and healthy
    assert len(seen[0]) == linear.SMALL_ROWS[-1], "the worker reports its choice in Ready"
    assert counters["small_paths"] == alternating
    assert streamed == reference() and [f.token_ids for f in finals] == reference()


def test_a_store_replica_sent_to_its_kv_port_resumes_the_same(tiny_ckpt_dir, monkeypatch):
    """A worker the store's shared memory is not offered to (one the controller cannot kill, e.g.
    started by hand) sends each step's increment to the store's KV port instead, and resumes alike."""
    monkeypatch.setattr(ReplicaStore, "segment", lambda self, pipeline, stage: "")
    cfg = _cfg(tiny_ckpt_dir, mode="disaggregated", prompt_depth=1, token_depth=1)
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, "token-0", "kill", 20, replicated=True)
    assert failures == 1 and recoveries == 1 and healthy
    assert counters["resumed"] > 0 and counters["recomputed"] < counters["lost"], counters
    assert counters["store_port_bytes"] > 0
    assert streamed == reference() and [f.token_ids for f in finals] == reference()


@pytest.mark.parametrize("kw", [dict(replication="none"), dict()], ids=["recompute", "replica"])
def test_a_killed_worker_of_a_swapping_pipeline_changes_no_token(tiny_ckpt_dir, kw):
    """Microbatch swapping on (the pool in host memory, two device regions per stage): a worker killed
    mid-generation is replaced and every stream is the engine's, recomputed or resumed."""
    expected = reference()
    cfg = _cfg(tiny_ckpt_dir, mode="colocated", depth=2, swapping=True, **kw)
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, "colocated-1", "kill", 20,
                                                                          replicated="replication" not in kw)
    assert failures == 1 and recoveries == 1 and healthy
    assert streamed == expected and [f.token_ids for f in finals] == expected


@pytest.mark.parametrize("kw, victim", [(dict(mode="colocated", depth=2), "colocated-0"),
                                        (dict(mode="disaggregated", prompt_depth=1, token_depth=1), "token-0")],
                         ids=["colocated-2", "disagg-1-1:token:store"])
def test_a_hung_worker_is_fenced_and_replaced(tiny_ckpt_dir, kw, victim):
    """A stopped worker is taken for lost after the heartbeat timeout and killed before its
    replacement restores (one writing the store's shared memory must never write again)."""
    expected = reference()
    cfg = _cfg(tiny_ckpt_dir, heartbeat_timeout_s=1.5, **kw)
    streamed, finals, (failures, recoveries, healthy) = run_with_failure(cfg, victim, "stop", 10,
                                                                          replicated=cfg.replicates(cfg.pipelines()[-1]) == "store")
    assert failures == 1 and recoveries == 1 and healthy
    assert streamed == expected
    if cfg.replicates(cfg.pipelines()[-1]) == "store":
        assert counters["resumed"] > 0


def test_two_failures_in_a_row(tiny_ckpt_dir):
    expected = reference()
    cfg = _cfg(tiny_ckpt_dir, mode="disaggregated", prompt_depth=1, token_depth=1)

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        streamed = [[] for _ in PROMPTS]

        async def one(i):
            async for out in ctrl.generate(PROMPTS[i], params(i), f"r{i}"):
                streamed[i] += out.new_token_ids

        def kill(name):
            return lambda: os.kill(ctrl.stages[name].process.pid, signal.SIGKILL)

        fired = on_loop_thread(ctrl, (lambda: ctrl.generated >= 20, kill("token-0")),
                               (lambda: ctrl.generated >= 80, kill("prompt-0")))
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            assert len(fired) == 2, fired
            await recovered(ctrl, 2)
            return streamed, ctrl.recovery.failures, ctrl.recovery.recoveries
        finally:
            await ctrl.shutdown()

    streamed, failures, recoveries = asyncio.run(main())
    assert streamed == expected and failures == 2 and recoveries == 2


class KillFirstReplacement(SubprocessLauncher):
    """Starts the cluster normally; the first replacement dies as soon as it is started (a failure
    during recovery), the next one is healthy."""

    def __init__(self, initial: int) -> None:
        super().__init__()
        self.initial, self.starts = initial, 0

    def start(self, name, controller_addr, host, secret):
        self.starts += 1
        proc = super().start(name, controller_addr, host, secret)
        if self.starts == self.initial + 1:
            proc.kill()
        return proc


def test_a_failure_during_recovery_is_retried(tiny_ckpt_dir):
    expected = reference()
    cfg = _cfg(tiny_ckpt_dir, mode="colocated", depth=2)

    async def main():
        launcher = KillFirstReplacement(initial=2)
        ctrl = Controller(cfg, launcher=launcher)
        await ctrl.start()
        streamed = [[] for _ in PROMPTS]

        async def one(i):
            async for out in ctrl.generate(PROMPTS[i], params(i), f"r{i}"):
                streamed[i] += out.new_token_ids

        fired = on_loop_thread(ctrl, (lambda: ctrl.generated >= 20,
                                      lambda: os.kill(ctrl.stages["colocated-0"].process.pid, signal.SIGKILL)))
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            assert fired
            return streamed, ctrl.recovery.failures, ctrl.recovery.recoveries, launcher.starts
        finally:
            await ctrl.shutdown()

    streamed, failures, recoveries, starts = asyncio.run(main())
    assert streamed == expected and failures == 1 and recoveries == 1 and starts == 4

"""The controller with real worker processes (ZeroMQ sockets, real SIGKILL): same tokens as the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import torch

import pytest

from kvflow.controller.controller import Controller
from kvflow.serving.backend import BackendUnavailable
from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.pipeline import even_split
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import SchedulerConfig

from conftest import run_to_completion, tiny_engine

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 70)), [11, 12]]
LENGTHS = [12, 3, 9, 1, 6, 10]  # unequal: some microbatch members finish early


def reference(prompts, lengths):
    eng = tiny_engine(num_kv_blocks=256, block_size=4)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    final = run_to_completion(eng)
    return [final[r.request_id].token_ids for r in reqs]


async def _collect(ctrl, prompt, n, rid):
    toks, last = [], None
    async for out in ctrl.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), rid):
        toks += out.new_token_ids
        last = out
    return toks, last


def serve(cfg: ClusterConfig, prompts, lengths, ahead: list | None = None, after=None):
    """`ahead`, if given, gets the number of decode-ahead seqs each pipeline scheduled; `after(ctrl)`, if
    given, is awaited once every request finished, before the stats are read and the controller stops."""
    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            results = await asyncio.gather(*[_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(prompts, lengths))])
            if after is not None:
                await after(ctrl)
            stats = ctrl.stats()
            free = [p.kv_manager.num_free_blocks for p in ctrl.pipelines]
            if ahead is not None:
                ahead.extend(p.sched.ahead_seqs for p in ctrl.pipelines)
            for p in ctrl.pipelines:  # every batch came back, timed: its round trip holds its stages' compute
                assert p.step_log and not p.sent_at and all(0 < r.busy_s <= r.round_trip_s for r in p.step_log)
        finally:
            await ctrl.shutdown()
        return results, stats, free

    return asyncio.run(main())


def _cfg(tiny_ckpt_dir, num_kv_blocks=128, **kw) -> ClusterConfig:
    base = dict(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=num_kv_blocks, block_size=4), microbatch_size=2,
                prompt_microbatch_size=2, heartbeat_timeout_s=10.0)
    base.update(kw)
    return ClusterConfig(**base)


@pytest.mark.parametrize(
    "kw",
    [dict(mode="colocated", depth=1), dict(mode="colocated", depth=2),
     dict(mode="disaggregated", prompt_depth=1, token_depth=1), dict(mode="disaggregated", prompt_depth=1, token_depth=2),
     dict(mode="disaggregated", prompt_depth=2, token_depth=1),
     dict(mode="disaggregated", prompt_depth=1, token_depth=1, decode_ahead=False)],
    ids=["colocated-1", "colocated-2", "disagg-1-1", "disagg-1-2", "disagg-2-1", "disagg-1-1-serial"],
)
def test_every_layout_gives_the_engine_tokens(tiny_ckpt_dir, kw):
    cfg = _cfg(tiny_ckpt_dir, **kw)
    results, stats, free = serve(cfg, PROMPTS, LENGTHS)
    assert [toks for toks, _ in results] == reference(PROMPTS, LENGTHS)
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    assert free == [128] * len(free), "KV blocks leaked"
    assert stats.generated_tokens_total == sum(LENGTHS)


@pytest.mark.parametrize(
    "kw",
    [dict(mode="colocated", depth=1), dict(mode="disaggregated", prompt_depth=1, token_depth=1),
     dict(mode="disaggregated", prompt_depth=2, token_depth=1), dict(mode="colocated", depth=2, decode_ahead_depth=2),
     dict(mode="disaggregated", prompt_depth=1, token_depth=2, decode_ahead_depth=2)],
    ids=["colocated-1", "disagg-1-1", "disagg-2-1", "colocated-2", "disagg-1-2"],
)
def test_decoding_ahead_gives_the_engine_tokens(tiny_ckpt_dir, kw):
    # the decoding pipeline runs greedy decodes one step ahead (its first stage feeds in the token its
    # last stage sampled: its own, or sent to it, where deeper pipelines are asked to); requests finish
    # at their last token, whatever was computed after it
    cfg = _cfg(tiny_ckpt_dir, microbatch_size=6, prompt_microbatch_size=6, **kw)  # (decode_ahead: on by default)
    ahead: list[int] = []
    results, stats, free = serve(cfg, PROMPTS, LENGTHS, ahead)
    assert ahead[-1] > 0 and sum(ahead[:-1]) == 0, "only the decoding pipeline decodes ahead"
    assert [toks for toks, _ in results] == reference(PROMPTS, LENGTHS)
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    assert free == [128] * len(free), "KV blocks leaked"
    assert stats.generated_tokens_total == sum(LENGTHS)


LONG = [list(range(3, 3 + 30)), list(range(40, 68)), [7] * 26, list(range(60, 91))]


@pytest.mark.parametrize(
    "kw",
    [dict(mode="colocated", depth=1), dict(mode="colocated", depth=2), dict(mode="disaggregated", prompt_depth=1, token_depth=1),
     dict(mode="disaggregated", prompt_depth=1, token_depth=2), dict(mode="disaggregated", prompt_depth=2, token_depth=1),
     dict(mode="colocated", depth=1, decode_ahead=False),
     dict(mode="disaggregated", prompt_depth=1, token_depth=1, decode_ahead=False)],
    ids=["colocated-1", "colocated-2", "disagg-1-1", "disagg-1-2", "disagg-2-1", "colocated-1-serial", "disagg-1-1-serial"],
)
def test_chunked_prefill_and_preemption_under_a_small_kv_budget(tiny_ckpt_dir, kw):
    # 4 requests of ~30 prompt + 14 output tokens = 11 blocks each of 4 tokens; 24 blocks cannot hold them
    # all, so running requests are preempted (recompute) and come back; prompts arrive in 8-token chunks.
    # (admitted greedily: the default KV reservation would run them one after the other instead)
    lengths = [14, 14, 14, 14]
    sched = SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8, reserve_kv=False)
    cfg = ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=24, block_size=4, scheduler=sched),
                        microbatch_size=4, prompt_microbatch_size=4, heartbeat_timeout_s=30.0, **kw)

    async def main():
        ctrl = Controller(cfg)
        await ctrl.start()
        try:
            results = await asyncio.gather(*[_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(LONG, lengths))])
            return results, ctrl.preemptions, [p.kv_manager.num_free_blocks for p in ctrl.pipelines], {p.name: p.batch_log for p in ctrl.pipelines}
        finally:
            await ctrl.shutdown()

    results, preemptions, free, logs = asyncio.run(main())
    assert [t for t, _ in results] == reference(LONG, lengths)
    assert preemptions > 0, "the budget was meant to force preemption"
    first = logs["prompt" if kw["mode"] == "disaggregated" else "colocated"]
    assert any(0 < n < len(LONG[int(rid[1:])]) for seqs in first for rid, n in seqs), "prompts were meant to be chunked"
    assert free == [24] * len(free), "KV blocks leaked"


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_request_aborted_while_decoding_ahead_frees_its_blocks_and_changes_no_other(tiny_ckpt_dir, mode):
    # r0 is dropped by its client after 3 tokens (its batch and the one decoding ahead are in flight):
    # its blocks come back once both return, and the others get the engine's tokens
    prompts, lengths = PROMPTS[:4], [6, 30, 30, 30]

    async def main():
        ctrl = Controller(_cfg(tiny_ckpt_dir, mode=mode, depth=1, microbatch_size=4, prompt_microbatch_size=4))
        await ctrl.start()
        try:
            async def dropped():
                got = []
                gen = ctrl.generate(prompts[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), "r0")
                async for out in gen:
                    got += out.new_token_ids
                    if len(got) >= 3:
                        break
                await gen.aclose()
                return got

            rest = [_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(prompts, lengths)) if i]
            got, *results = await asyncio.gather(dropped(), *rest)
            deadline = time.monotonic() + 60  # (the abort reaches the loop thread on its next turn)
            while (ctrl.reqs or any(p.in_flight for p in ctrl.pipelines)) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            ahead = ctrl.pipelines[-1].sched.ahead_seqs
            return got, results, [p.kv_manager.num_free_blocks for p in ctrl.pipelines], ahead
        finally:
            await ctrl.shutdown()

    got, results, free, ahead = asyncio.run(main())
    expected = reference(prompts, [100] + lengths[1:])
    assert got == expected[0][:len(got)] and len(got) >= 3 and ahead > 0
    assert [t for t, _ in results] == expected[1:]
    assert free == [128] * len(free), "KV blocks leaked"


def test_early_finishing_microbatch_is_replaced(tiny_ckpt_dir):
    # DejaVu's microbatch baseline policy, microbatch size 2, depth 1: one slot. r0 stops after 1 token,
    # r1 after 8; r2 and r3 must start as soon as the whole first microbatch is done, and all outputs
    # must match the engine.
    prompts, lengths = PROMPTS[:4], [1, 8, 2, 2]
    results, _, _ = serve(_cfg(tiny_ckpt_dir, mode="colocated", depth=1, policy="microbatch"), prompts, lengths)
    assert [t for t, _ in results] == reference(prompts, lengths)
    first_done = results[1][1].finish_time
    assert results[2][1].first_token_time >= first_done - 1e-3  # microbatch-level: joined after mb 0 ended


def test_kv_streamed_equals_prompt_kv(tiny_ckpt_dir):
    from conftest import tiny_config

    cfg = tiny_config(num_layers=2)
    prompts, lengths = PROMPTS[:2], [3, 3]

    async def main():
        ctrl = Controller(_cfg(tiny_ckpt_dir, mode="disaggregated"))
        await ctrl.start()
        try:
            res = await asyncio.gather(*[_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(prompts, lengths))])
            # the prompt worker reports its KV bytes with its heartbeats: wait for the report that covers both
            # requests (it never grows past them, so a wrong count stays wrong and fails below)
            deadline = time.monotonic() + 60
            while ctrl.stats().kv_bytes_streamed_total < kv_bytes and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return res, ctrl.stats()
        finally:
            await ctrl.shutdown()

    kv_bytes = 2 * cfg.num_layers * cfg.kv_size * 4 * sum(len(p) for p in prompts)
    res, stats = asyncio.run(main())
    assert stats.kv_bytes_streamed_total == kv_bytes


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "messages"])
def test_hidden_states_between_stages_pass_through_the_ring_or_the_messages_alike(tiny_ckpt_dir, monkeypatch, ring):
    # stages the controller started on its own host pass hidden states through a shared-memory ring;
    # where /dev/shm cannot hold one they travel on the step messages, with the same tokens
    import kvflow.controller.workers as workers

    if not ring:
        def full(*_):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(workers, "create_ring", full)
    check_hidden_states(tiny_ckpt_dir, ring)


async def next_heartbeat(stage) -> None:
    """Until `stage` (a controller's `StageHandle`) sent a heartbeat after now: what it reports (its
    counters) then covers every step before."""
    done, deadline = time.monotonic(), time.monotonic() + 60
    while stage.last_heartbeat <= done + 0.05 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def check_hidden_states(tiny_ckpt_dir, ring: bool, device: str = "cpu") -> None:
    """Colocated depth 2 on `device` gives the engine's tokens, with its stage 1 mapping a ring (or
    not), and stage 0 putting every hidden state it computed into it (or none)."""
    from dataclasses import replace

    from conftest import tiny_config

    hidden = tiny_config(num_layers=2).hidden_size * 4  # (float32)
    expected = hidden * (sum(map(len, PROMPTS)) + sum(n - 1 for n in LENGTHS)) if ring else 0  # every token stage 0 computed
    cfg = _cfg(tiny_ckpt_dir, mode="colocated", depth=2)
    cfg = replace(cfg, engine=replace(cfg.engine, device=device))

    mapped = []

    async def after(ctrl):
        mapped.extend(s.hidden_shm for s in ctrl.pipelines[0].stages)
        await next_heartbeat(ctrl.pipelines[0].stages[0])  # (stage 0 reports its ring bytes with its heartbeats)

    res, stats, _ = serve(cfg, PROMPTS, LENGTHS, after=after)
    assert [t for t, _ in res] == reference(PROMPTS, LENGTHS)
    assert mapped == [False, ring]
    assert stats.hidden_ring_bytes_total == expected


def test_without_recovery_a_killed_worker_fails_in_flight_requests_quickly(tiny_ckpt_dir):
    # Deterministic on any machine speed: a first request completes (so the prompt->token KV link is up),
    # then token-0 is stopped (SIGSTOP) before the victim request arrives, so
    # after the prompt pipeline has produced the first token the request provably still has 199 tokens
    # left and cannot make progress; only then is token-0 killed. The heartbeat timeout is long, so the
    # failure can only be detected through the process exit (the error says "died").
    async def main():
        ctrl = Controller(_cfg(tiny_ckpt_dir, mode="disaggregated", heartbeat_timeout_s=120.0, recovery="none"))
        await ctrl.start()
        victim = ctrl.stages["token-0"].process
        try:
            _, warm = await asyncio.wait_for(_collect(ctrl, [5, 6, 7], 2, "warm-up"), timeout=60)
            assert warm.finish_reason == "length"
            os.kill(victim.pid, signal.SIGSTOP)
            outputs = ctrl.generate(PROMPTS[1], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "victim")
            first = await asyncio.wait_for(outputs.__anext__(), timeout=60)
            assert first.new_token_ids and not first.finished  # generating, with work left it cannot do
            os.kill(victim.pid, signal.SIGKILL)
            t0 = time.monotonic()
            last = first
            async for out in outputs:
                last = out
            elapsed = time.monotonic() - t0
            assert last.finished and last.finish_reason == "error"
            assert "token-0" in last.error and "died" in last.error
            assert elapsed < ctrl.cfg.heartbeat_timeout_s  # detected by the exit, not by a heartbeat timeout
            assert not ctrl.healthy()
            with pytest.raises(BackendUnavailable, match="token-0"):  # refused up front: the API answers 503
                await _collect(ctrl, [5, 6], 3, "late")
        finally:
            if victim.poll() is None:
                os.kill(victim.pid, signal.SIGKILL)
            await ctrl.shutdown()

    asyncio.run(main())


def test_a_bug_in_the_controller_loop_fails_requests_instead_of_hanging(tiny_ckpt_dir):
    # An exception on the controller thread (here: applying a step's result) used to end the thread
    # silently, and every client waited forever. Now it fails the requests with the error and the
    # controller reports itself unhealthy; a later request is refused with the same error.
    async def main():
        ctrl = Controller(_cfg(tiny_ckpt_dir, mode="colocated", depth=1))
        await ctrl.start()
        sched = ctrl.pipelines[0].sched

        def broken_update(out, sampled):
            raise RuntimeError("injected scheduler bug")

        sched.update = broken_update
        try:
            _, last = await asyncio.wait_for(_collect(ctrl, [5, 6, 7], 4, "r0"), timeout=60)
            assert last.finished and last.finish_reason == "error"
            assert "controller error" in last.error and "injected scheduler bug" in last.error
            assert not ctrl.healthy()
            with pytest.raises(BackendUnavailable, match="injected scheduler bug"):
                await _collect(ctrl, [5, 6], 3, "late")
        finally:
            await ctrl.shutdown()

    asyncio.run(main())


def test_bad_configs_and_requests_rejected(tiny_ckpt_dir):
    with pytest.raises(ValueError, match="mode"):
        ClusterConfig(mode="ring")
    with pytest.raises(ValueError, match="depth"):
        even_split(2, 3)
    with pytest.raises(ValueError, match="positive"):
        ClusterConfig(microbatch_size=0)
    with pytest.raises(ValueError, match="policy"):
        ClusterConfig(policy="fifo")


def test_external_workers_started_from_the_printed_commands_serve_the_engine_tokens(tiny_ckpt_dir):
    # --external-workers: the controller starts nothing and prints one command per worker; run exactly
    # those commands (this host for <this-host>) and the cluster must behave like a spawned one.
    import io
    import shlex
    import subprocess
    import sys
    import threading

    from kvflow.controller.launcher import ExternalLauncher

    printed = io.StringIO()
    cfg = _cfg(tiny_ckpt_dir, mode="disaggregated", prompt_depth=1, token_depth=2)
    ctrl = Controller(cfg, launcher=ExternalLauncher(printed))
    starter = threading.Thread(target=ctrl.start_blocking)
    starter.start()
    deadline = time.monotonic() + 60
    while printed.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the three commands are printed before the controller waits for the workers
    procs = []
    try:
        for line in printed.getvalue().splitlines():
            env_kv, *argv = shlex.split(line)
            key, value = env_kv.split("=", 1)
            assert argv[:2] == ["kvflow", "worker"]
            argv = [sys.executable, "-m", "kvflow.cli.main"] + [a.replace("<this-host>", "127.0.0.1") for a in argv[1:]]
            procs.append(subprocess.Popen(argv, env={**os.environ, key: value}))
        starter.join(120)
        assert ctrl.healthy()

        async def main():
            try:
                return await asyncio.gather(*[_collect(ctrl, p, n, f"r{i}") for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))])
            finally:
                await ctrl.shutdown()

        results = asyncio.run(main())
        assert [t for t, _ in results] == reference(PROMPTS, LENGTHS)
        assert [p.wait(30) for p in procs] == [0, 0, 0]  # Shutdown reached them
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_pipeline_modes_honour_the_engine_dtype(tiny_ckpt_dir):
    # the dtype travels to the workers in the handshake (config tree): bfloat16 weights, KV and hidden states
    from kvflow.engine.engine import LLMEngine

    ref_engine = LLMEngine.from_config(EngineConfig(model=str(tiny_ckpt_dir), dtype="bfloat16", num_kv_blocks=256, block_size=4))
    assert ref_engine.kv_cache.layout.dtype == torch.bfloat16
    reqs = [ref_engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in zip(PROMPTS, LENGTHS)]
    final = run_to_completion(ref_engine)
    expected = [final[r.request_id].token_ids for r in reqs]
    cfg = ClusterConfig(engine=EngineConfig(model=str(tiny_ckpt_dir), dtype="bfloat16", num_kv_blocks=128, block_size=4),
                        mode="disaggregated", token_depth=2, microbatch_size=4, heartbeat_timeout_s=30.0)
    results, _, _ = serve(cfg, PROMPTS, LENGTHS)
    assert [t for t, _ in results] == expected

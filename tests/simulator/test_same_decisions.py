"""The simulator and a real controller run make the same scheduling decisions.

One workload (6 requests of the controller tests: unequal prompts and output lengths, greedy,
`ignore_eos`, fixed `max_tokens`, all submitted before the controller's loop starts) and one
step-time function (`sim_helpers.paced_seconds`: the simulator's stage time, and what every real
worker process sleeps before computing a batch, see `paced_worker.py`; scaled per layout, below).
The real run uses a tiny
random-weight model in real worker processes; the simulator the same `ClusterConfig`
(`SimConfig.from_cluster`). Compared: every pipeline's sequence of batches, each as
[(request id, number of new tokens)] — which requests, in which order, with which prompt chunks.

What legitimately depends on timing, and how it is pinned down here:
- batch ids: the controller calls `schedule()` on an idle pipeline at every loop turn, and an empty
  output still consumes an id, so ids are compared by position, not value;
- the order of events the scheduler sees (a batch returning before or after another pipeline's, a
  request joining the token side before or after a token batch returns, two results drained in one
  loop turn). The paced step times keep those events at least `MARGIN` apart in the simulated
  timeline (asserted below), far more than the real run's per-step overhead (a few ms), so the
  real run sees them in the simulator's order. Each layout's step times are scaled down until its
  closest two such events are `SPACING` apart (measured on 2 vCPUs, two CPU-bound processes beside
  the test: two events of the real run came at most 11 ms closer than simulated, 7 ms in a scaled
  layout).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from dataclasses import replace

import paced_worker
import pytest
from sim_helpers import PacedPerf
from test_controller import next_heartbeat

from kvflow.config import ClusterConfig, EngineConfig
from kvflow.controller.controller import Controller
from kvflow.controller.launcher import ForkedWorker
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import SchedulerConfig
from kvflow.simulator import Failure, SimConfig, Simulator, Workload

import numpy as np

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, [3, 1, 4, 1, 5, 9, 2, 6], list(range(50, 70)), [11, 12]]
LENGTHS = [12, 3, 9, 1, 6, 10]
LONG = [list(range(3, 3 + 30)), list(range(40, 68)), [7] * 26, list(range(60, 91))]  # 11 blocks of 4 each
MARGIN = 0.025  # seconds between events of different pipelines (or two results) in the simulated timeline
SPACING = 0.030  # seconds between the closest two of a layout's events, its step times scaled to that (MARGIN and more)


class PacedLauncher:
    """Forks `paced_worker.run` (a real worker that sleeps the paced step time, scaled by `pace`,
    first) from the multiprocessing fork server, as `SubprocessLauncher` forks workers; the first
    start of worker `victim` kills itself when its `die_at`-th step arrives."""

    def __init__(self, pace: float, victim: str | None = None, die_at: int = 0) -> None:
        self.pace, self.victim, self.die_at, self.starts = pace, victim, die_at, []
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["kvflow.worker.worker"])  # (as `SubprocessLauncher`'s, if it starts it)

    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> ForkedWorker:
        die_at = self.die_at if name == self.victim and name not in self.starts else 0
        self.starts.append(name)
        proc = self.ctx.Process(target=paced_worker.run, name=f"kvflow-worker-{name}", daemon=True,
                                args=(controller_addr, name, host, secret, dict(os.environ), os.getpid(), self.pace, die_at))
        proc.start()
        return ForkedWorker(proc)


def run_controller(cfg: ClusterConfig, prompts, lengths, launcher: PacedLauncher, heartbeat: bool = False):
    """The real run's batches per pipeline; with `heartbeat`, its last stage's heartbeat after the last
    request finished is in before the controller stops (its counters cover the run)."""
    async def collect(ctrl, i):
        params = SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=True)
        async for out in ctrl.generate(prompts[i], params, str(i)):
            last = out
        return last

    async def main():
        ctrl = Controller(cfg, launcher=launcher)
        tasks = []
        for i in range(len(prompts)):  # queued in order before the loop thread exists
            tasks.append(asyncio.create_task(collect(ctrl, i)))
            while len(ctrl.submissions) < i + 1:
                await asyncio.sleep(0)
        await ctrl.start()
        try:
            outs = await asyncio.gather(*tasks)
            if heartbeat:
                await next_heartbeat(ctrl.pipelines[-1].stages[-1])
        finally:
            await ctrl.shutdown()
        assert [len(o.token_ids) for o in outs] == lengths
        assert all(o.finish_reason == "length" for o in outs)
        return {p.role: list(p.batch_log) for p in ctrl.pipelines}, ctrl

    return asyncio.run(main())


class TimedSimulator(Simulator):
    """Records when each pipeline's passes are sent, start on stage 0 (later than sent when it is busy:
    behind the pass before it) and return."""

    def __init__(self, *a) -> None:
        super().__init__(*a, log_batches=True)
        self.returns: list[tuple[float, str]] = []
        self.sends: list[tuple[float, str]] = []
        self.starts: list[tuple[float, str]] = []

    def dispatch(self, p, wire_id, out, free, streams):
        self.sends.append((self.now, p.role))
        self.starts.append((max(self.ready_at(p, wire_id, out), p.stage_free[0]), p.role))  # (`SimPipeline.place`'s stage 0)
        return super().dispatch(p, wire_id, out, free, streams)

    def on_pass_done(self, now, p, wire_id):
        self.returns.append((now, p.role))
        return super().on_pass_done(now, p, wire_id)


def run_simulator(cfg: ClusterConfig, prompts, lengths, failures=(), pace: float = 1.0
                  ) -> tuple[dict[str, list[list[tuple[str, int]]]], TimedSimulator]:
    n = len(prompts)
    w = Workload(np.zeros(n), np.array([len(p) for p in prompts], dtype=np.int64), np.array(lengths, dtype=np.int64),
                 tuple(tuple(p) for p in prompts))
    sim_cfg = SimConfig.from_cluster(cfg, max_model_len=256)
    sim_cfg = replace(sim_cfg, failures=failures, recovery=replace(sim_cfg.recovery, detect_s=0.0, restart_s=1.0, restore_s=0.0))
    sim = TimedSimulator(sim_cfg, PacedPerf(pace), w)
    res = sim.run()
    assert np.all(res.completions == 1)
    return {p.role: list(p.batch_log) for p in sim.prompt + sim.token}, sim


def closest(sim: TimedSimulator) -> float:
    """The shortest time between two returns whose order the real run must see as the simulator
    does: two of one pipeline, or one of the prompt pipeline and one of the token pipeline."""
    gaps = [float("inf")]
    for role in ("both", "prompt", "token"):
        times = [t for t, r in sim.returns if r == role]
        gaps += [b - a for a, b in zip(times, times[1:])]
    prompt, token = ([t for t, r in sim.returns if r == role] for role in ("prompt", "token"))
    return min(gaps + [abs(a - b) for a in prompt for b in token])


SHARED = [list(range(20, 32)) + [5, 6], list(range(20, 32)) + [7, 8, 9], [1, 2, 3], list(range(20, 32)) + [4]]
CHUNKED = SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8)
LAYOUTS = {
    "colocated-2": dict(mode="colocated", depth=2),
    "colocated-2-chunked": dict(mode="colocated", depth=2, sched=CHUNKED),
    "colocated-2-preempt": dict(mode="colocated", depth=2, blocks=24, lengths=[14, 14, 14, 14], prompts=LONG,
                                sched=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8, reserve_kv=False)),
    "colocated-2-microbatch": dict(mode="colocated", depth=2, policy="microbatch"),
    "colocated-3-swapping": dict(mode="colocated", depth=3, swapping=True, blocks=32),
    "colocated-2-prefix": dict(mode="colocated", depth=2, prompts=SHARED, lengths=[8, 3, 6, 4]),
    "disagg-1-1": dict(mode="disaggregated", prompt_depth=1, token_depth=1),
    # (chunks of 10: with chunks of 8 a prompt step and a decode-ahead token step return within MARGIN)
    "disagg-1-1-chunked": dict(mode="disaggregated", prompt_depth=1, token_depth=1,
                               sched=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=10)),
    "disagg-1-1-microbatch": dict(mode="disaggregated", prompt_depth=1, token_depth=1, policy="microbatch"),
    "disagg-1-3-swapping": dict(mode="disaggregated", prompt_depth=1, token_depth=3, swapping=True, blocks=32),
    "disagg-1-1-prefix": dict(mode="disaggregated", prompt_depth=1, token_depth=1, prompts=SHARED, lengths=[8, 3, 6, 4]),
    # one-stage decoding pipelines decode ahead (`ClusterConfig.decode_ahead`, on by default), or not
    "colocated-1": dict(mode="colocated", depth=1),
    "disagg-1-1-serial": dict(mode="disaggregated", prompt_depth=1, token_depth=1, decode_ahead=False),
    # the token worker's decode buffers built to decode ahead (CUDA's graphs, run eagerly here): a step is
    # launched behind the one before, which is read back and sent after (`worker.compute`)
    "disagg-1-1-device-ahead": dict(mode="disaggregated", prompt_depth=1, token_depth=1,
                                    env={"KVFLOW_TEST_DECODE_BUFFERS": "1"}),
    "disagg-1-1-preempt": dict(mode="disaggregated", prompt_depth=1, token_depth=1, blocks=20,
                               lengths=[12, 14, 13, 14], prompts=LONG,
                               sched=SchedulerConfig(max_num_batched_tokens=16, prefill_chunk_size=8)),
    # a worker SIGKILLed when its n-th step arrives (the simulator: a failure right after that step is sent)
    "colocated-2-fail-recompute": dict(mode="colocated", depth=2, replication="none", fail=("colocated", 0, 5)),
    "colocated-2-fail-resume": dict(mode="colocated", depth=2, fail=("colocated", 0, 5)),
    "disagg-1-1-fail-prompt": dict(mode="disaggregated", prompt_depth=1, token_depth=1, replication="none",
                                   fail=("prompt", 0, 3)),
    "disagg-1-1-fail-token": dict(mode="disaggregated", prompt_depth=1, token_depth=1, replication="none",
                                  decode_ahead=False, fail=("token", 0, 4)),
    # decoding ahead, a token stage is idle only before its first step (then each step starts as the one
    # before it returns): it dies with that step and the one decoding ahead of it in flight
    "disagg-1-1-ahead-fail-token": dict(mode="disaggregated", prompt_depth=1, token_depth=1, replication="none",
                                        fail=("token", 0, 1)),
    # a deeper pipeline decoding ahead (when asked): stage 0 also waits for the last stage's ids; its 3rd
    # step finds it idle
    "colocated-2-ahead": dict(mode="colocated", depth=2, decode_ahead_depth=2),
    "colocated-2-ahead-fail-resume": dict(mode="colocated", depth=2, decode_ahead_depth=2, fail=("colocated", 0, 3)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_simulator_and_controller_make_the_same_decisions(tiny_ckpt_dir, tiny4_ckpt_dir, name, monkeypatch):
    kw = dict(LAYOUTS[name])
    for key, value in kw.pop("env", {}).items():  # (the workers' environment: the launcher passes this process's)
        monkeypatch.setenv(key, value)
    ckpt = tiny4_ckpt_dir if max(kw.get("depth", 1), kw.get("token_depth", 1)) > 2 else tiny_ckpt_dir
    sched, blocks = kw.pop("sched", SchedulerConfig()), kw.pop("blocks", 128)
    prompts, lengths = kw.pop("prompts", PROMPTS), kw.pop("lengths", LENGTHS)
    fail = kw.pop("fail", None)
    cfg = ClusterConfig(engine=EngineConfig(model=str(ckpt), num_kv_blocks=blocks, block_size=4, scheduler=sched),
                        microbatch_size=2, prompt_microbatch_size=2, heartbeat_timeout_s=30.0, **kw)

    def simulate(pace: float) -> tuple[tuple[Failure, ...], dict, TimedSimulator]:
        failures = ()
        if fail is not None:  # when the victim's n-th step arrives, in a run without the failure
            pipeline, stage, n = fail
            assert stage == 0  # (every step of a pipeline reaches its stage 0: the n-th sent)
            role = "token" if pipeline == "token" else "prompt"
            _, clean = run_simulator(cfg, prompts, lengths, pace=pace)
            sent = [t for t, r in clean.sends if r == ("both" if pipeline == "colocated" else pipeline)]
            if cfg.scheduler_for(cfg.pipelines()[-1 if pipeline == "token" else 0]).decode_ahead:
                # the paced worker dies when it takes the step up; a step sent while the one before it computes
                # starts as that one's output leaves, which may or may not get out before the worker dies
                starts = [t for t, r in clean.starts if r == ("both" if pipeline == "colocated" else pipeline)]
                assert starts[n - 1] == sent[n - 1], "decoding ahead, the victim must be idle when its n-th step is sent"
            failures = (Failure(sent[n - 1] + 1e-6, role, 0, stage),)
        return failures, *run_simulator(cfg, prompts, lengths, failures, pace)

    # Every time in the simulation scales with the step times (all requests arrive at 0, hops and KV
    # transfers are free; restarts do not move a decision, checked from 0.01 to 5 s), so the layout's
    # step times are scaled for its closest two returns to be SPACING apart: the same decisions in
    # the shortest timeline that keeps them that far apart.
    _, unpaced, sim = simulate(1.0)
    pace = min(1.0, SPACING / closest(sim))
    failures, simulated, sim = simulate(pace)
    assert simulated == unpaced
    launcher = PacedLauncher(pace, *((f"{fail[0]}-{fail[1]}", fail[2]) if fail is not None else ()))
    # Precondition: no two returns closer than MARGIN (of one pipeline: so two results are never
    # drained in one loop turn; of two pipelines: so the real run cannot see them reordered), and
    # nothing returns within MARGIN after a failure (the controller notices the loss first).
    assert closest(sim) >= MARGIN
    for f in failures:
        assert not any(0 < t - f.time < MARGIN for t, _ in sim.returns)
    first = simulated["prompt" if cfg.mode == "disaggregated" else "both"]
    if "chunked" in name:
        assert any(0 < k < len(prompts[int(rid)]) for batch in first for rid, k in batch), "prompts meant to be chunked"
    if "prefix" in name:
        assert any(0 < k < len(prompts[int(rid)]) for batch in first for rid, k in batch), "meant to hit the prefix cache"
    real, ctrl = run_controller(cfg, prompts, lengths, launcher, heartbeat="device-ahead" in name)
    assert real == simulated
    if "device-ahead" in name:
        assert ctrl.pipelines[-1].stages[0].launched_ahead > 0, "the token worker was meant to launch steps behind others"
    if "preempt" in name:
        assert ctrl.preemptions > 0, "the budget was meant to force preemption"
    ahead = ctrl.pipelines[-1].sched.ahead_seqs
    assert ahead == sim.executor.pipelines[-1].sched.ahead_seqs
    assert ahead > 0 if ctrl.pipelines[-1].sched.config.decode_ahead else ahead == 0
    if "swapping" in name:  # both schedulers fit batches to the device regions
        assert ctrl.pipelines[-1].sched.config.swap_regions == sim.executor.pipelines[-1].sched.config.swap_regions > 0
    if fail is not None:
        assert ctrl.recovery.recoveries == 1 and launcher.starts.count(f"{fail[0]}-{fail[1]}") == 2
        if cfg.replication == "none":
            assert sim.restarts > 0  # requests lost their KV (the prompt side: prompts in flight)
        else:
            assert sim.restarts == 0 and ctrl.recovery.resumed > 0

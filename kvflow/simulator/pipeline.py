"""One simulated pipeline: the executor's view of it (`kvflow.sched.executor.PipelineState`: the
real scheduler over a block pool, its queue and batches in flight) plus the clocks of its stages and
their KV links — the simulator's counterpart of `controller/pipeline.py`.

Every stage of a pipeline takes the same time for a given batch and serves in arrival order, so a
batch's whole pass is placed on all stages when it is sent to stage 0 (the tandem-queue recursion
`finish[k] = max(finish[k-1] + hop, stage_free[k]) + service`): one event per pass, exact for FIFO
stages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvflow.kv.manager import KVCacheManager
from kvflow.perf.perf_model import PerfModel
from kvflow.sched.executor import PipelineState
from kvflow.sched.scheduler import Scheduler
from kvflow.simulator.config import PipelineGroup


@dataclass(slots=True)
class Pass:
    """What the clock knows of a batch in flight: its stage time, when it returns, and (prompt
    role) when the KV it computed has left every stage."""

    stage_time: float
    done_at: float  # when it leaves the last stage (its `PassDone`)
    kv_done: float = 0.0


class SimPipeline(PipelineState):
    """`depth` machines in a line running one `Scheduler` with up to `depth` batches in flight; `perf`
    prices its steps, transfers and memory (prompt and token pipelines may run on different
    hardware or tensor-parallel degrees)."""

    def __init__(self, role: str, index: int, spec: PipelineGroup, kv: KVCacheManager, sched: Scheduler,
                 queue: deque, perf: PerfModel, log_batches: bool = False) -> None:
        super().__init__(role, spec.depth, spec.microbatch, sched, kv, queue, log_batches)
        self.index, self.spec, self.perf = index, spec, perf
        self.stage_free = [0.0] * spec.depth
        self.link_free = [0.0] * spec.depth  # prompt role: when each stage's KV link is next free
        self.passes: dict[int, Pass] = {}  # wire id -> clock data of the batches in `in_flight`
        self.busy = 0.0  # seconds each stage computed (the same on every stage); counted on completion
        self.epoch = 0  # bumped by a failure: passes placed in an older epoch are void
        self.number = 0  # position among all pipelines, prompt side first: orders simultaneous events
        self.ahead = None  # a run ahead not yet applied (`kvflow.simulator.steady.Ahead`)
        self.lag: dict = {}  # wire id -> its microbatch's passes run ahead, not yet applied (`steady.Behind`)

    def place(self, now: float, stage_time: float, hop: float, duration=None) -> list[tuple[float, float]]:
        """Place one pass sent to stage 0 at `now`; return each stage's (start, end). `duration(k,
        start)`, when given, is stage k's time for the pass starting at `start` (else `stage_time`)."""
        sf, spans, t = self.stage_free, [], now
        for k in range(self.depth):
            if k:
                t += hop
            start = t if t > sf[k] else sf[k]
            t = sf[k] = start + (stage_time if duration is None else duration(k, start))
            spans.append((start, t))
        return spans

    def stream(self, spans: list[tuple[float, float]], transfer: list[float]) -> float:
        """Prompt role: each stage sends its layers' KV of the pass (`transfer[k]` seconds) over its
        own link, starting when it starts computing them (layer by layer) and ending no earlier
        than its last layer; returns when the last stage's share has left."""
        done = 0.0
        for k, (start, end) in enumerate(spans):
            begin = start if start > self.link_free[k] else self.link_free[k]
            self.link_free[k] = max(begin + transfer[k], end)
            done = max(done, self.link_free[k])
        return done

    def fail(self, back_at: float) -> None:
        """Void every pass in flight; stages and links are unavailable until `back_at`."""
        self.epoch += 1
        self.passes.clear()
        self.down = True
        self.stage_free = [back_at] * self.depth
        self.link_free = [max(x, back_at) for x in self.link_free]

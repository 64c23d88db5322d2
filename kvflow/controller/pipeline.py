"""One pipeline of worker processes as the controller sees it: its stages, its block pool, its
scheduler (the one scheduling core, `kvflow.sched`) and the batches it has in flight."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvflow.config import PipelineSpec
from kvflow.controller.launcher import WorkerHandle
from kvflow.kv.manager import KVCacheManager
from kvflow.sched.scheduler import Scheduler, SchedulerOutput

LOG_LEN = 100_000


def even_split(num_layers: int, depth: int) -> list[tuple[int, int]]:
    """Layer ranges of `depth` stages differing by at most one layer (earlier stages get the extra)."""
    from kvflow.streaming.topology import PipelineTopology  # the same split the KV connector plans with

    bounds = PipelineTopology.even(num_layers, depth, [1]).layer_bounds
    return list(zip(bounds, bounds[1:]))


@dataclass
class StageHandle:
    name: str
    stage: int
    layers: tuple[int, int]
    process: WorkerHandle | None = None  # None for a worker started by hand on another host
    step_addr: str = ""
    kv_addr: str = ""
    replica_addr: str = ""  # where the previous stage's replica is received ("" if none)
    replica_bytes_sent: int = 0
    last_heartbeat: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    kv_bytes_sent: int = 0
    dropped_messages: int = 0
    swap: dict = field(default_factory=dict)  # its swapper's counters (microbatch swapping), from heartbeats
    alive: bool = True


@dataclass
class Pipeline:
    """`depth` stages; up to `depth` batches of its scheduler in flight (one per stage)."""

    spec: PipelineSpec
    stages: list[StageHandle]
    kv: KVCacheManager
    sched: Scheduler
    in_flight: dict[int, SchedulerOutput] = field(default_factory=dict)
    pending_free: list[str] = field(default_factory=list)  # forget these with the next step
    # The latest LOG_LEN batches, for tests and benchmarks: (scheduler batch id, [(request, new tokens)])
    # and (tokens, the step's compute seconds summed over the stages).
    batch_log: deque[tuple[int, list[tuple[str, int]]]] = field(default_factory=lambda: deque(maxlen=LOG_LEN))
    step_log: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=LOG_LEN))
    # replication watermark: stage -> request -> tokens [0, n) of that stage's KV held by its replica
    watermark: dict[int, dict[str, int]] = field(default_factory=dict)
    ready: deque = field(default_factory=deque)  # token role, microbatch policy: KV in place (`sched.handoff`)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def microbatch(self) -> int:
        return self.spec.microbatch_size

    @property
    def layer_bounds(self) -> list[int]:
        return [self.stages[0].layers[0]] + [s.layers[1] for s in self.stages]

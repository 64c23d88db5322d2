"""One pipeline of worker processes as the controller sees it: the executor's state of it (its
scheduler, block pool, queue and batches in flight) plus its stages and their replication."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from kvflow.config import PipelineSpec
from kvflow.controller.launcher import WorkerHandle
from kvflow.kv.manager import KVCacheManager
from kvflow.sched.executor import LOG_LEN, PipelineState
from kvflow.sched.scheduler import Scheduler


def even_split(num_layers: int, depth: int) -> list[tuple[int, int]]:
    """Layer ranges of `depth` stages differing by at most one layer (earlier stages get the extra)."""
    from kvflow.streaming.topology import PipelineTopology  # the same split the KV connector plans with

    bounds = PipelineTopology.even(num_layers, depth, [1]).layer_bounds
    return list(zip(bounds, bounds[1:]))


class StepRecord(NamedTuple):
    """One returned batch of a pipeline: its tokens, its compute summed over the stages (what the
    workers timed), and its round trip as the controller saw it (dispatch to result: the compute plus
    every hop's encoding, transport and decoding, and waiting behind the pipeline's other batches)."""

    tokens: int
    busy_s: float
    round_trip_s: float


@dataclass
class StageHandle:
    name: str
    stage: int
    layers: tuple[int, int]
    process: WorkerHandle | None = None  # None for a worker started by hand on another host
    step_addr: str = ""
    kv_addr: str = ""
    replica_addr: str = ""  # where the previous stage's replica is received ("" if none)
    replica_shm: bool = False  # that replica is the controller's shared-memory segment, mapped (`Ready`)
    hidden_shm: bool = False  # it mapped the ring its input hidden states arrive in (`Ready`)
    small_paths: list[str] = field(default_factory=list)  # the CPU linear paths it chose (`Ready`), for its replacement
    replica_bytes_sent: int = 0
    hidden_bytes_sent: int = 0  # its output hidden states written into the next stage's ring (heartbeats)
    last_heartbeat: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    kv_bytes_sent: int = 0
    dropped_messages: int = 0
    swap: dict = field(default_factory=dict)  # its swapper's counters (microbatch swapping), from heartbeats
    launched_ahead: int = 0  # its steps launched behind the one before on the device (heartbeats)
    alive: bool = True


class Pipeline(PipelineState):
    """`depth` stages; up to `depth` batches of its scheduler in flight (one per stage); what the
    executor needs of it is `PipelineState`'s."""

    def __init__(self, spec: PipelineSpec, stages: list[StageHandle], kv: KVCacheManager, sched: Scheduler) -> None:
        super().__init__(spec.role, len(stages), spec.microbatch_size, sched, kv)
        self.spec, self.stages = spec, stages
        self.step_log: deque[StepRecord] = deque(maxlen=LOG_LEN)  # the latest LOG_LEN returned batches
        self.sent_at: dict[int, float] = {}  # wire id of a batch in flight -> when it was dispatched
        # replication watermark: stage -> request -> tokens [0, n) of that stage's KV held by its replica
        self.watermark: dict[int, dict[str, int]] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def layer_bounds(self) -> list[int]:
        return [self.stages[0].layers[0]] + [s.layers[1] for s in self.stages]

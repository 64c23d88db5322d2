"""A pipeline of machines as a line of FIFO stages, and the microbatches that flow through it.

Every stage of a pipeline takes the same time for a given microbatch operation and serves in
arrival order, so a microbatch's whole pass can be placed on all stages the moment it enters
stage 0 (the tandem-queue recursion `finish[k] = max(finish[k-1], stage_free[k]) + service`).
That makes one event per pass instead of one per stage, and is exact for FIFO stages.
"""

from __future__ import annotations

from collections import deque

from kvflow.simulator.config import PipelineSpec


class Microbatch:
    """Requests that move through a pipeline together. `done` counts generated tokens (the
    prompt pass makes the first); requests are sorted by output length and leave as they finish."""

    __slots__ = ("id", "reqs", "next_out", "done", "target", "prompt_len", "pass_time", "ready")

    def __init__(self, mb_id: int, reqs: list[int], out_len: list[int], prompt_len: int, done: int) -> None:
        reqs.sort(key=out_len.__getitem__)
        self.id = mb_id
        self.reqs = reqs
        self.next_out = 0  # index of the first request in `reqs` not yet finished
        self.done = done
        self.target = out_len[reqs[-1]]
        self.prompt_len = prompt_len
        self.pass_time = 0.0  # stage time of the pass in progress
        self.ready = 0.0  # when the pass in progress entered stage 0

    @property
    def in_prompt(self) -> bool:
        return self.done == 0

    @property
    def live(self) -> list[int]:
        """Requests of this microbatch that have not finished."""
        return self.reqs[self.next_out:]


class Pipeline:
    """`depth` machines in a line; at most `depth` microbatches in flight (one per stage)."""

    __slots__ = ("role", "index", "depth", "microbatch", "stage_free", "busy", "active", "epoch",
                 "down", "queue", "listed", "admitting", "link_free")

    def __init__(self, role: str, index: int, spec: PipelineSpec, queue: deque) -> None:
        self.role = role
        self.index = index
        self.depth = spec.depth
        self.microbatch = spec.microbatch
        self.stage_free = [0.0] * spec.depth
        self.busy = 0.0  # seconds each stage has computed (the same on every stage)
        self.active: dict[int, Microbatch] = {}
        self.epoch = 0  # bumped by a failure; passes scheduled in an older epoch are void
        self.down = False
        self.queue = queue  # requests waiting for this pipeline (shared deque or its own)
        self.listed = False  # in the simulator's list of pipelines with a free slot
        self.admitting = True  # rigid rounds: open only while the pipeline is empty
        self.link_free = 0.0  # prompt pipelines: when the KV streaming link is next free

    @property
    def free_slots(self) -> int:
        return self.depth - len(self.active)

    def run_pass(self, ready: float, stage_time: float, hop: float) -> tuple[float, float]:
        """Place one pass entering stage 0 at `ready`; return (start at stage 0, finish at last)."""
        sf = self.stage_free
        t = ready if ready > sf[0] else sf[0]
        start = t
        t += stage_time
        sf[0] = t
        for k in range(1, len(sf)):
            t += hop
            if sf[k] > t:
                t = sf[k]
            t += stage_time
            sf[k] = t
        return start, t

    def fail(self, now: float, back_at: float) -> None:
        """Void every pass in flight; stages are unavailable until `back_at`."""
        self.epoch += 1
        self.down = True
        self.stage_free = [back_at] * self.depth
        self.link_free = max(self.link_free, back_at)

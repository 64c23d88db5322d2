"""A stage's replication: after each step, the KV the step appended goes where the stage's replica
lives, with the same block ids (a replica mirrors the cache block for block). Two ways, chosen by
the stage's `Route`:

- **in place** (`Route.replica_shm`): the replica is kept in a shared-memory segment of the
  controller's (the replica store's own cache, or the one a ring's next stage holds: `held_replica`)
  and the controller offered it; this worker maps it and copies the step's slots into it (packed
  into one of two reused `Staging` buffers: on CUDA gathered on the device and copied to pinned
  memory on a side stream), then reports the tokens (`Replicated` with its own stage and the step's
  epoch). No socket or acknowledgement: the copy and one small message. On CUDA the step loop only
  launches the gather and the device-to-host copy; a thread waits for the copy, writes the segment
  (page faults and all) and reports, so the next step computes meanwhile. A report follows its
  write, so the controller's watermarks never count a token the replica does not hold. On the CPU
  the copy runs inline: there it would take the cores the next step computes on;
- **as an increment** (`Route.replica_to`): one chunk per step to a KV port (the next stage's
  replica, or the store of a worker that is not offered or cannot map the segment), packed at once
  and sent by a `KVSender`'s background thread while the next step computes; the receiving side
  reports it.

Either way the copy starts after the step's output left, so it overlaps the controller's work on it.
`restore` is the worker's part of a recovery: a replica (or its own KV) sent back, `Restore`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import torch

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.streaming.chunk import Segment
from kvflow.streaming.connector import KVSender, send_restore
from kvflow.streaming.primitives import OutStream
from kvflow.streaming.region import token_slots, unpack
from kvflow.streaming.staging import Staging, StagingPool
from kvflow.streaming.transports.shm_segment import attach
from kvflow.wire import Replicated, Restore, Route, Step, WorkerError

log = logging.getLogger(__name__)


def mapped(layout: KVLayout, segment: str, name: str) -> KVCache | None:
    """The controller's shared-memory segment `segment` as a cache of `layout`, or None (none named,
    or not mappable here: another host, or a segment of another size; logged)."""
    if not segment:
        return None
    try:
        return KVCache.over(layout, attach(segment))
    except (OSError, ValueError) as e:
        log.warning("%s: cannot map the replica segment %s (%s); the replica goes over TCP", name, segment, e)
        return None


def held_replica(layout: KVLayout, segment: str, name: str) -> KVCache:
    """The replica a ring's stage keeps of the previous stage: the segment mapped (its `shared` is
    True: the previous stage may write into it in place), or a host cache of its own."""
    return mapped(layout, segment, name) or KVCache(layout, "cpu")


class Replicator:
    """Replication of one worker's `cache` for one route (a new route: a new Replicator). `report`
    takes the `Replicated` messages (and, from the background thread, a `WorkerError` when a copy
    fails). `background` (default: on CUDA, or where KVFLOW_TEST_REPLICATION_THREAD=1 asks for it:
    the CPU tests of the CUDA way, worker processes included) lands in-place copies on a thread."""

    STAGINGS = 2  # in-place copies in flight: a step's gather waits while both are unlanded
    LAND_TIMEOUT_S = 60.0  # how long a step waits for one of them before it fails

    def __init__(self, cache: KVCache, stage: int, name: str, route: Route, epoch: int, secret: bytes,
                 report: Callable[[Replicated | WorkerError], None], background: bool | None = None) -> None:
        self.cache, self.stage, self.name, self.report = cache, stage, name, report
        self.replica = mapped(cache.layout, route.replica_shm, name)  # (in place)
        self.stagings = StagingPool(self.STAGINGS, cache.device) if self.replica is not None else None
        self.sender: KVSender | None = None  # (as increments)
        self.written = 0  # bytes written in place
        self._jobs: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background is None:
            background = cache.device.type == "cuda" or os.environ.get("KVFLOW_TEST_REPLICATION_THREAD") == "1"
        if self.replica is not None and background:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._land_loop, name=f"{name}-replicate", daemon=True)
            self._thread.start()
        if self.replica is None and route.replica_to:
            from kvflow.streaming.transports.tcp import TcpSender

            out = OutStream(TcpSender(route.replica_to), f"{name}->replica@{epoch}", secret)
            self.sender = KVSender(cache, stage, {stage + 1: out}, mode="overlap")

    @property
    def nbytes(self) -> int:
        """Replica bytes copied so far, either way."""
        return self.written + (self.sender.nbytes if self.sender is not None else 0)

    def step(self, msg: Step, tables: dict[str, tuple[int, ...]]) -> None:
        """Replicate what `msg` appended (tokens [start, context) of each seq; from token 0 when the
        step carries the whole table: a request new to this pipeline, handed off with KV the
        replica has never seen, or re-sent after a recovery)."""
        lay = self.cache.layout
        rids, starts, ends, slots = [], [], [], []
        for s in msg.seqs:
            a = 0 if s.full_table else s.start
            rids.append(s.rid)
            starts.append(a)
            ends.append(s.context_len)
            slots += token_slots(tables[s.rid], a, s.context_len, lay.block_size, s.rid)
        if self.replica is None:
            self.sender.send_increment([Segment(*g) for g in zip(rids, starts, ends)], slots, msg.epoch)
            return
        at = torch.tensor(slots, dtype=torch.long)
        try:
            staging = self.stagings.acquire(timeout=self.LAND_TIMEOUT_S)  # (back-pressure: both copies still landing)
        except TimeoutError:  # a hang, not a slow copy: fail the step, and the controller recovers
            raise RuntimeError(f"{self.name}: no replica copy landed in {self.LAND_TIMEOUT_S:g} s") from None
        data, copied = staging.pack(self.cache, (lay.layer_start, lay.layer_end), at)  # (CUDA: to pinned memory)
        job = (staging, data, copied, at, Replicated(self.name, rids, starts, ends, self.stage, msg.epoch))
        if self._jobs is None:
            self._land(*job)
        else:
            self._jobs.put(job)

    def _land(self, staging: Staging, data: torch.Tensor, copied, at: torch.Tensor, done: Replicated) -> None:
        """Write a packed copy into the replica once it is in host memory, then report it."""
        try:
            if copied is not None:
                copied.synchronize()
            unpack(self.replica, self.cache.layout.layer_start, self.cache.layout.layer_end, "kv", at, data)
            self.written += data.numel() * data.element_size()
        finally:
            self.stagings.release(staging)
        self.report(done)

    def _land_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._land(*job)
            except Exception as e:  # the step that packed it has returned: the controller recovers
                log.exception("%s: replicating in place failed", self.name)
                self.report(WorkerError(self.name, f"replicating in place failed: {type(e).__name__}: {e}", job[-1].epoch))
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def drain(self) -> None:
        """Wait until every copy begun has been written and reported (a worker does at a `Fence`, and
        `close` does for a new route: nothing of an older step lands after the recovery's restores)."""
        if self._jobs is not None:
            self._jobs.join()

    def close(self, wait: bool = True) -> None:
        """Stop the sending thread (`wait=False`: without waiting for its peer, which may be gone) and
        the landing thread (after the copies it has: they write shared memory, no peer to wait for)."""
        if self.sender is not None:
            self.sender.close(wait=wait)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self.replica = None  # (the mapping closes once nothing views it)


def restore(cache: KVCache | None, msg: Restore, name: str, secret: bytes) -> None:
    """`Restore`: send tokens [0, n) of the listed requests from `cache` (the worker's own, "main", or
    the replica it holds) to `msg.to_addr` (a replacement's cache or replica), synchronously: the
    pipeline is paused for the recovery."""
    from kvflow.streaming.transports.tcp import TcpSender

    if cache is None:
        raise ValueError(f"{name} has no {msg.source!r} KV to restore from")
    out = OutStream(TcpSender(msg.to_addr), f"{name}-restore@{msg.epoch}", secret)
    try:
        send_restore(cache, msg.items, out, msg.dst_stage, msg.epoch)
    finally:
        out.sender.close()

"""The controller's host store of KV replicas: where a stage with no other stage to replicate to
(a pipeline of depth 1, or `ClusterConfig.replication="store"`) copies the KV each step appends.

One host `KVCache` per replicated stage (that stage's layers, the pipeline's block ids), in a POSIX
shared-memory segment the store creates (and unlinks on close). The store also creates the segments
of ring replicas (`add(port=False)`): the holder (the next stage) maps one as the replica it keeps,
and the stage it replicates writes into it in place, as into the store's (below), when the
controller can kill both. Two ways into the store's own caches:
- a worker on this host maps the segment (`Route.replica_shm`) and writes each step's increment in
  place, then reports it (`Replicated`): no socket or acknowledgement on either side (on CUDA a
  thread of the worker lands the copy), and nothing in the controller's process but the report. The controller offers the segment only to
  workers whose processes it can kill (a hung one is killed before its replacement restores, so a
  stale writer cannot touch the replica again);
- any other worker sends increments to a `KVReceiver` on a KV port of the controller's internal
  interface (`Route.replica_to`); what arrived is queued as (pipeline, stage, request ids, spans)
  for the controller loop to advance its watermark.
In a recovery the loop sends a stage's replica back into the replacement's cache (`send_restore`).
The store lives in the controller process, so it survives any worker; it costs as much host memory
as the replicated stages' KV (a plain host tensor where no segment can be created, e.g. a full
/dev/shm: then every worker uses the KV port).
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from multiprocessing import shared_memory

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.streaming.connector import KVReceiver, send_restore
from kvflow.streaming.primitives import InStream, OutStream
from kvflow.streaming.transports.tcp import TcpSender
from kvflow.streaming.transports.shm_segment import create, release
from kvflow.streaming.transports.tcp_receiver import TcpReceiver

log = logging.getLogger(__name__)

SHM_SHARE = 0.9  # of /dev/shm's free room, what pools sized from GPU memory may give their replicas


def fit_replicas(pools: dict[str, int], replica_block_bytes: dict[str, int], room: int | None) -> dict[str, int]:
    """Pools sized from GPU memory (`engine.memory.pipeline_pools`), cut so that the replicas of the
    replicated pipelines (`replica_block_bytes`: pipeline -> the bytes one block of all its stages'
    replicas takes; the store keeps each in a segment of /dev/shm, reserved in full when made) fit in
    `SHM_SHARE` of `room` (/dev/shm's free bytes; None: no /dev/shm, nothing cut). A replica mirrors
    its stage block for block, so a pool the host cannot mirror would leave its replicas to a
    plain host cache, fed over TCP, that grows with the pool. Every replicated pool is cut by the
    same factor; at least one block each."""
    need = sum(pools[p] * b for p, b in replica_block_bytes.items())
    if room is None or need <= SHM_SHARE * room:
        return dict(pools)
    scale = SHM_SHARE * room / need
    return {p: max(1, int(n * scale)) if p in replica_block_bytes else n for p, n in pools.items()}


class ReplicaStore:
    def __init__(self, host: str, secret: bytes) -> None:
        self.host, self.secret = host, secret
        self.caches: dict[tuple[str, int], KVCache] = {}
        self.receivers: dict[tuple[str, int], KVReceiver] = {}
        self.addresses: dict[tuple[str, int], str] = {}
        self.segments: dict[tuple[str, int], shared_memory.SharedMemory] = {}  # (each cache's memory)
        self.events: deque[tuple[str, int, list[str], list[tuple[int, int]]]] = deque()
        self.dropped = 0
        self._lock = threading.Lock()

    def add(self, pipeline: str, stage: int, layout: KVLayout, port: bool = True) -> str:
        """A replica of `pipeline`'s stage `stage` (its layers, in `layout`): its shared-memory segment
        and, with `port` (the store holds it), a host cache over it fed by a KV port, whose address
        is returned ("" without). Without `port` the segment is for a ring: the next stage maps it as
        the replica it holds (`WorkerSpec.replica_shm`)."""
        key = (pipeline, stage)
        nbytes = math.prod(layout.shape) * layout.dtype.itemsize
        try:
            seg = create(f"kvflow-replica-{uuid.uuid4().hex[:16]}", nbytes)
        except OSError as e:
            log.warning("the replica of %s stage %d is not in shared memory (%s): it travels over TCP", pipeline, stage, e)
            seg = None
        else:
            self.segments[key] = seg
        if not port:
            return ""
        cache = KVCache.over(layout, seg.buf) if seg is not None else KVCache(layout, "cpu")
        rx = TcpReceiver(self.host)

        def arrived(rids: list[str], spans: list[tuple[int, int]]) -> None:
            self.events.append((pipeline, stage, rids, spans))

        recv = KVReceiver(cache, InStream(rx, secret=self.secret), arrived, self._dropped, increments=True)
        recv.start()
        self.caches[key], self.receivers[key], self.addresses[key] = cache, recv, rx.address
        return rx.address

    def _dropped(self, message: str) -> None:
        with self._lock:
            self.dropped += 1

    def fence(self, epoch: int) -> None:
        """A new epoch: partly received increments are void; chunks of older epochs are dropped."""
        for r in self.receivers.values():
            r.fence(epoch)

    def restore(self, pipeline: str, stage: int, items: Sequence[tuple[str, int, Sequence[int]]], to_addr: str,
                epoch: int) -> None:
        """Send tokens [0, n) of each (request, n, table) of the stage's replica to `to_addr`."""
        out = OutStream(TcpSender(to_addr), f"store-{pipeline}-{stage}-restore@{epoch}", self.secret)
        try:
            send_restore(self.caches[(pipeline, stage)], items, out, stage, epoch)
        finally:
            out.sender.close()

    def segment(self, pipeline: str, stage: int) -> str:
        """The shared-memory segment holding the stage's replica ("": none, use the KV address)."""
        seg = self.segments.get((pipeline, stage))
        return seg.name if seg is not None else ""

    @property
    def nbytes(self) -> int:
        """Bytes received on the KV ports (increments written in place by workers are not counted here)."""
        return sum(r.nbytes for r in self.receivers.values())

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.receivers.clear()
        self.caches.clear()  # (the views into the mappings go before the mappings)
        for seg in self.segments.values():
            release(seg)
        self.segments.clear()

"""The controller's host store of KV replicas: where a stage with no other stage to replicate to
(a pipeline of depth 1, or `ClusterConfig.replication="store"`) sends the KV each step appends.

One host `KVCache` per replicated stage (that stage's layers, the pipeline's block ids), each fed by
its own `KVReceiver` on a KV port of the controller's internal interface; what arrived is queued as
(pipeline, stage, request ids, spans) for the controller loop to advance its watermark. In a
recovery the loop sends a stage's replica back into the replacement's cache (`send_restore`).
The store lives in the controller process, so it survives any worker; it costs as much host memory
as the replicated stages' KV.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.streaming.connector import KVReceiver, send_restore
from kvflow.streaming.primitives import InStream, OutStream
from kvflow.streaming.transports.tcp import TcpSender
from kvflow.streaming.transports.tcp_receiver import TcpReceiver


class ReplicaStore:
    def __init__(self, host: str, secret: bytes) -> None:
        self.host, self.secret = host, secret
        self.caches: dict[tuple[str, int], KVCache] = {}
        self.receivers: dict[tuple[str, int], KVReceiver] = {}
        self.addresses: dict[tuple[str, int], str] = {}
        self.events: deque[tuple[str, int, list[str], list[tuple[int, int]]]] = deque()
        self.dropped = 0
        self._lock = threading.Lock()

    def add(self, pipeline: str, stage: int, layout: KVLayout) -> str:
        """A replica of `pipeline`'s stage `stage` (its layers, in `layout`); returns its KV address."""
        key = (pipeline, stage)
        cache = KVCache(layout, "cpu")
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

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.receivers.values())

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()

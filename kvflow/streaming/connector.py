"""The KV connector: the one path by which a worker's KV leaves its cache for another worker.

Split as in vLLM's KV connector, on DéjàVuLib's level-3 primitives:

- scheduler side, `plan_handoff(src_bounds, dst_bounds, n)`: which layer ranges of which requests
  go from each source stage to each destination stage (`plan_transfers` over the two pipelines'
  topologies, any depth pair). The controller attaches it to a prompt batch.
- worker side, sending, `KVSender`: installed as the model's layer hook, it sends each layer's KV
  of the planned requests as soon as the layer has written it (`stream_out` restricted to that
  layer). "naive" and "buffered" send on the compute thread; "overlap" packs the layer (or, for
  small transfers, a run of layers up to `COALESCE_BYTES`) into a pooled staging buffer (one copy,
  so the source blocks may be reused as soon as the step returns) and a background thread flushes
  it while the next layers compute.
- worker side, receiving, `KVReceiver`: a background thread that fetches, verifies and writes chunks
  into the cache through a `KVSink`. Each chunk names its destination block table and the total
  token count of each request in its metadata, so the sink expects exactly the planned region
  (this stage's layers, tokens [0, total)) and the receiver reports a request once all of it has
  arrived; anything unplanned or repeated is rejected.

The same two classes carry the fault-tolerance traffic (`kvflow.worker`): replication (each stage of
a pipeline sends the KV each step appended to the next stage's replica, `KVSender.send_increment`)
and, in a recovery, the restore of a replica into a replacement's cache. A replica holds the same
block ids as its source, so an increment names its flat cache slots instead of block tables: one
self-contained chunk per step, which a receiver writes without per-request state or block tables
(a request's table would otherwise travel, and be decoded, with every step it is in).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvflow.kv.cache import KVCache
from kvflow.streaming.chunk import ChunkDesc, Segment
from kvflow.streaming.errors import ChunkMismatch, StreamingError
from kvflow.streaming.primitives import InStream, OutStream, fetch_many, flush
from kvflow.streaming.region import KVRegion, SeqRegion
from kvflow.streaming.scatter import KVSink
from kvflow.streaming.staging import StagingPool
from kvflow.streaming.topology import PipelineTopology, Transfer, plan_transfers, stream_out

SendMode = Literal["naive", "buffered", "overlap"]
SEND_MODES = ("naive", "buffered", "overlap")
# Overlap mode: consecutive layers of one transfer are packed into one chunk until it holds this
# many bytes (or the transfer's last layer is written). A chunk costs a pack, a header, a checksum
# and its share of an acknowledgement whatever its size (TCP moves 64 KB chunks much further below
# the raw socket's speed than 1 MB chunks: docs/results.md, 2026-11-23 transports); a short
# prompt's layer is tens of KB, so sending it layer by layer spent more on chunks than on bytes.
COALESCE_BYTES = 1 << 20


@dataclass(frozen=True)
class HandoffRequest:
    """One request of a hand-off: tokens [token_start, token_end) of its KV, from `src_blocks` at the
    source into `dest_blocks` at the destination (a table covering [0, total)). `dest_start`: the
    destination holds [0, dest_start) already (its prefix cache) and expects only [dest_start, total)."""

    request_id: str
    token_start: int
    token_end: int
    total: int
    src_blocks: tuple[int, ...]
    dest_blocks: tuple[int, ...]
    dest_start: int = 0


def plan_handoff(src_bounds: Sequence[int], dst_bounds: Sequence[int], num_requests: int) -> list[Transfer]:
    """Scheduler side: the transfers that move `num_requests` requests' KV (one source batch, landing
    in the destination's one pool) from a pipeline with layer bounds `src_bounds` to one with
    `dst_bounds`."""
    return plan_transfers(PipelineTopology(tuple(src_bounds), (num_requests,)),
                          PipelineTopology(tuple(dst_bounds), (num_requests,)))


class KVSender:
    """Worker side of a source stage (see module docstring).

    Contract: `begin(requests, plan)` before a step (requests in the plan's order; the plan is this
    step's transfers, any stage's); install `on_layer` as the model's layer hook; `finish()` waits
    until everything sent so far is acknowledged. A background failure is re-raised by the next
    `begin`, `on_layer` or `finish`, so a dead peer fails the step that depends on it.
    """

    def __init__(self, cache: KVCache, stage: int, outs: dict[int, OutStream], mode: SendMode = "overlap",
                 pool_size: int = 4, timeout: float = 30.0, coalesce_bytes: int = COALESCE_BYTES) -> None:
        if mode not in SEND_MODES:
            raise ValueError(f"mode must be one of {SEND_MODES}, got {mode!r}")
        self.cache, self.stage, self.outs, self.mode, self.timeout = cache, stage, outs, mode, timeout
        self.pool_size = pool_size
        self.coalesce_bytes = coalesce_bytes
        lay = cache.layout
        self._token_layer_bytes = 2 * lay.num_kv_heads * lay.head_dim * torch.empty((), dtype=lay.dtype).element_size()
        self._next: list[int] = []  # overlap: per planned transfer, its first layer not yet packed
        self.nbytes = 0
        self.chunks = 0
        self._requests: list[SeqRegion] = []
        self._metas: list[dict] = []
        self._plan: list[Transfer] = []
        self._epoch = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._pool = StagingPool(pool_size, cache.device)
        self._thread: threading.Thread | None = None
        if mode == "overlap":
            self._thread = threading.Thread(target=self._sender, name="kv-sender", daemon=True)
            self._thread.start()

    def begin(self, requests: Sequence[HandoffRequest], plan: Sequence[Transfer], epoch: int = 0) -> None:
        """`epoch` travels with the chunks: a receiver drops chunks from before its last reset."""
        self._raise_pending()
        self._requests = [SeqRegion(r.request_id, r.src_blocks, r.token_start, r.token_end) for r in requests]
        self._metas = [{"total": r.total, "blocks": list(r.dest_blocks), **({"start": r.dest_start} if r.dest_start else {})}
                       for r in requests]
        self._plan = [t for t in plan if t.src == self.stage]
        self._next = [t.layer_start for t in self._plan]
        self._epoch = epoch

    @property
    def active(self) -> bool:
        return bool(self._plan)

    def on_layer(self, layer: int, batch=None) -> None:
        """The layer hook: send `layer`'s KV of every planned request right after it was written."""
        self._raise_pending()
        for i, t in enumerate(self._plan):
            if not t.layer_start <= layer < t.layer_end:
                continue
            if self.mode == "overlap":  # layers coalesced up to `coalesce_bytes` per chunk
                lo = self._next[i]
                if layer + 1 == t.layer_end or (layer + 1 - lo) * self._layer_bytes(t) >= self.coalesce_bytes:
                    self._enqueue(t, lo, layer + 1)
                    self._next[i] = layer + 1
                continue
            meta = self._meta(t)
            st = stream_out(self.stage, self.cache, self._requests, [t], self.outs, self.mode, (layer, layer + 1), meta)
            for s in st.values():
                self.chunks, self.nbytes = self.chunks + s.chunks, self.nbytes + s.nbytes

    def _layer_bytes(self, t: Transfer) -> int:
        """Bytes of one layer of transfer `t`'s requests."""
        reqs = self._requests[t.request_start:t.request_end]
        return sum(r.token_end - r.token_start for r in reqs) * self._token_layer_bytes

    def _meta(self, t: Transfer) -> dict:
        reqs = self._requests[t.request_start:t.request_end]
        metas = self._metas[t.request_start:t.request_end]
        return {"epoch": self._epoch, "kv": {r.request_id: m for r, m in zip(reqs, metas)}}

    def send_increment(self, segments: Sequence[Segment], slots: Sequence[int], epoch: int) -> None:
        """Replication, after a step (overlap mode, one destination): the KV of `segments` (tokens
        [start, end) of each request, at the flat `slots` of this cache, in order), all of this
        cache's layers, as one chunk flushed by the background thread while the next step computes.
        One chunk per step rather than one per layer: a decode step appends little KV per layer, and
        a chunk costs a header, a checksum and an acknowledgement whatever its size. The chunk names
        the slots (the replica holds the same block ids), not block tables."""
        self._raise_pending()
        if self.mode != "overlap" or len(self.outs) != 1:
            raise ValueError("send_increment needs the overlap mode (a background thread) and one destination")
        lay = self.cache.layout
        at = np.asarray(slots, dtype="<i8")
        desc = ChunkDesc(tuple(segments), lay.layer_start, lay.layer_end, "kv")
        if desc.num_tokens != len(at):
            raise ValueError(f"{len(at)} slots for {desc.num_tokens} tokens")
        self._put(next(iter(self.outs)), desc, torch.from_numpy(at), {"epoch": epoch, "slots": at.tobytes()})

    def _enqueue(self, t: Transfer, layer_start: int, layer_end: int) -> None:
        region = KVRegion(tuple(self._requests[t.request_start:t.request_end]), layer_start, layer_end)
        self._put(t.dst, region.desc, region.slot_tensor(self.cache.layout.block_size), self._meta(t))

    def _put(self, dst: int, desc: ChunkDesc, slots: torch.Tensor, meta: dict) -> None:
        """Pack `desc`'s layers at `slots` into a pooled staging buffer (so the blocks may be reused as
        soon as the step returns) and queue it for the background thread."""
        try:
            staging = self._pool.acquire(timeout=self.timeout)
        except TimeoutError:
            self._raise_pending()
            raise StreamingError(f"KV sending fell {self.pool_size} buffers behind for {self.timeout}s") from None
        data, event = staging.pack(self.cache, (desc.layer_start, desc.layer_end), slots)
        self._queue.put((staging, dst, desc, data, event, meta))

    def finish(self) -> None:
        """Wait until all KV handed to this sender is sent and acknowledged."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            while not done.wait(0.05):
                self._raise_pending()
                if not self._thread.is_alive():
                    break
        self._raise_pending()
        for out in self.outs.values():
            out.drain()

    def close(self, wait: bool = True) -> None:
        """Stop the background thread after what is queued (`wait=False`: without waiting for it,
        e.g. when its peer is gone and the sends would only time out)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            if wait:
                self._thread.join(timeout=self.timeout)

    def _raise_pending(self) -> None:
        if self._error is not None:
            err = self._error
            raise StreamingError(f"KV streaming failed: {type(err).__name__}: {err}") from err

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            staging, dst, desc, data, event, meta = item
            try:
                if self._error is None:
                    if event is not None:
                        event.synchronize()
                    h = flush(self.outs[dst], desc, data, meta)
                    self.chunks, self.nbytes = self.chunks + 1, self.nbytes + h.nbytes
            except BaseException as e:  # surfaced on the compute thread at its next call
                self._error = e
            finally:
                self._pool.release(staging)


def send_restore(cache: KVCache, items: Sequence[tuple[str, int, Sequence[int]]], out: OutStream, dst_stage: int,
                 epoch: int) -> None:
    """Send tokens [0, n) of each (request, n, block table) in `items`, all of `cache`'s layers, to
    `out` (a `KVReceiver` that lands them in the same block ids), and wait until acknowledged: a
    replica brought back into a replacement worker's cache after a failure."""
    reqs = [HandoffRequest(str(rid), 0, int(n), int(n), tuple(int(b) for b in table), tuple(int(b) for b in table))
            for rid, n, table in items if int(n) > 0]
    if not reqs:
        return
    lay = cache.layout
    sender = KVSender(cache, 0, {dst_stage: out}, mode="buffered")
    try:
        sender.begin(reqs, [Transfer(0, dst_stage, lay.layer_start, lay.layer_end, 0, len(reqs), 0, 0)], epoch)
        for layer in range(lay.layer_start, lay.layer_end):
            sender.on_layer(layer)
        sender.finish()
    finally:
        sender.close()


class KVReceiver:
    """Worker side of a destination stage: a background thread receiving chunks into `cache`.

    `on_complete(request_ids, spans)` is called (on that thread) when all the KV planned for a
    request in this cache's layers, tokens [start, total) (start 0 unless the sender's meta says,
    as replication's per-step increments do; `spans` holds the (start, total) pairs), has arrived; `on_error(message)` when a chunk is
    rejected and dropped (the sender is told through the acknowledgement). A completed request is
    forgotten, so the same request can be sent again later (recomputed after a preemption).
    `reset(epoch)` (after a failure) forgets every partly received request and from then on drops,
    unwritten, chunks sent in an older epoch. A replica's receiver (`increments=True`) also takes
    replication increments (`KVSender.send_increment`): each is complete in itself, written at the
    slots it names and reported at once; any other receiver rejects them.
    """

    def __init__(self, cache: KVCache, inp: InStream, on_complete: Callable[[list[str], list[tuple[int, int]]], None],
                 on_error: Callable[[str], None], increments: bool = False) -> None:
        self.cache = cache
        self.increments = increments
        self.inp = inp
        self.on_complete = on_complete
        self.on_error = on_error
        self.tables: dict[str, list[int]] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self.sink = KVSink(cache, self._resolve)
        self.nbytes = 0
        self.stale = 0  # chunks dropped because they were sent before the last reset
        self.epoch = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _resolve(self, rid: str, num_tokens: int) -> list[int]:
        return self.tables[rid]

    def fence(self, epoch: int) -> None:
        """A new epoch (`wire.Fence`): KV partly received is forgotten, chunks of older epochs are dropped."""
        with self.lock:
            self.epoch = epoch
            for rid in list(self.sink.expected):
                self.sink.forget(rid)
            self.tables.clear()
            self.spans.clear()

    def _expect_from(self, meta: dict) -> None:
        lay = self.cache.layout
        for rid, m in meta.get("kv", {}).items():
            if rid not in self.sink.expected:
                self.tables[rid] = [int(b) for b in m["blocks"]]
                self.spans[rid] = (int(m.get("start", 0)), int(m["total"]))
                self.sink.expect(rid, lay.layer_start, lay.layer_end, *self.spans[rid])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = fetch_many(self.inp, 64, timeout=0.2)
            except TimeoutError:
                continue
            except Exception as e:  # failed verification: already rejected back to its sender
                self.on_error(f"KV chunk rejected: {type(e).__name__}: {e}")
                continue
            for chunk in batch:
                self._write(chunk)

    def _write(self, chunk) -> None:
        done = []
        try:
            with chunk, self.lock:  # releasing the chunk acknowledges it (or reports the error)
                meta = chunk.header.meta
                if meta.get("epoch", 0) < self.epoch:
                    self.stale += 1
                    return
                if "slots" in meta:
                    done = self._increment(chunk, meta["slots"])
                else:
                    self._expect_from(meta)
                    self.sink.write(chunk)
                    self.nbytes += chunk.header.nbytes
                    for seg in chunk.header.desc.segments:
                        rid = seg.request_id
                        if rid in self.sink.expected and self.sink.complete_for([rid]):
                            done.append((rid, self.spans.pop(rid)))
                            self.sink.forget(rid)
                            self.tables.pop(rid, None)
        except Exception as e:
            self.on_error(f"KV chunk rejected: {type(e).__name__}: {e}")
            return
        if done:
            self.on_complete([r for r, _ in done], [n for _, n in done])

    def _increment(self, chunk, slots: object) -> list[tuple[str, tuple[int, int]]]:
        h = chunk.header
        if not self.increments:
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq} is a replication increment; this receiver holds no replica")
        if not isinstance(slots, bytes) or len(slots) % 8:
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq}: its slots are not a list of 64-bit integers")
        self.sink.write_at(chunk, np.frombuffer(slots, dtype="<i8").copy())
        self.nbytes += h.nbytes
        return [(seg.request_id, (seg.token_start, seg.token_end)) for seg in h.desc.segments]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

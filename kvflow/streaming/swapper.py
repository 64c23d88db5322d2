"""Microbatch swapping, worker side (DéjàVu §4.2.2): a stage's KV lives in host memory (`host`, the
block ids its scheduler accounts), and its device holds `regions` regions of `region_blocks` blocks
(`device`). Before a step, the KV its requests already have is swapped into the step's region (by a
background thread, while the previous step computes); after the step, only the KV the step appended
is written back. Where each request's blocks sit in the region is the scheduler's decision
(`ScheduledSeq.device_block_ids`); this module only moves the bytes, with the streaming library's
buffered, coalesced region copies (`staging.transfer`; on CUDA packed on the device, through pinned
host memory, on a side stream).

Ordering: steps reach a stage in order, and step n uses region n mod `regions`, so the swap-in of
step n waits until the step that used its region last has been written back (`done`)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvflow.kv.cache import KVCache
from kvflow.kv.manager import blocks_for
from kvflow.streaming.region import KVRegion, SeqRegion
from kvflow.streaming.staging import Staging, transfer


@dataclass(frozen=True)
class SwapSeq:
    """One request of a step: its host blocks, its blocks in the device region, and the tokens
    [start, end) the step computes (tokens [0, start) are swapped in first)."""

    request_id: str
    host_blocks: tuple[int, ...]
    device_blocks: tuple[int, ...]
    start: int
    end: int


class Swapper:
    """Contract: `prefetch(key, region, seqs)` queues the swap-in of a step (in step order);
    `wait(key)` blocks until it is in the device region (raising what the copy raised);
    `write_back(seqs)` copies the step's appended tokens back to host memory (compute thread, right
    after the forward); `done(key)` frees the region for the next step using it (call it for every
    prefetched step, run or dropped). `reset()` forgets pending steps (a recovery). `stats` holds
    swapped bytes and the seconds spent swapping in, in the background, and waiting for it."""

    def __init__(self, host: KVCache, device: KVCache, regions: int) -> None:
        if regions <= 0 or device.layout.num_blocks % regions:
            raise ValueError(f"{device.layout.num_blocks} device blocks do not split into {regions} regions")
        self.host, self.device, self.regions = host, device, regions
        self._free = [threading.Event() for _ in range(regions)]
        for e in self._free:
            e.set()
        self._region_of: dict[object, int] = {}
        self._ready: dict[object, threading.Event] = {}
        self._errors: dict[object, BaseException] = {}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._in_staging = Staging("cpu")  # host -> device: packed in host memory, then copied over
        self._out_staging = Staging(device.device)
        # On CUDA the swap-in runs on its own stream (the host cache is pinned), so it overlaps the
        # compute stream's kernels; the swap thread waits for its event before the step may start.
        self._stream = torch.cuda.Stream(device.device) if device.device.type == "cuda" else None
        self.stats = {"swap_in_bytes": 0, "swap_in_s": 0.0, "wait_s": 0.0, "write_back_bytes": 0, "write_back_s": 0.0}
        self._thread = threading.Thread(target=self._run, name="swap-in", daemon=True)
        self._thread.start()

    def _regions(self, seqs: list[SwapSeq], computed: bool) -> tuple[KVRegion, KVRegion] | None:
        """(host region, device region) of the tokens already computed ([0, start), in whole blocks)
        or of the step's tokens ([start, end))."""
        lay, bs = self.host.layout, self.host.layout.block_size
        src, dst = [], []
        for s in seqs:
            a, b = (0, blocks_for(s.start, bs) * bs) if computed else (s.start, s.end)
            if b > a:
                src.append(SeqRegion(s.request_id, s.host_blocks, a, b))
                dst.append(SeqRegion(s.request_id, s.device_blocks, a, b))
        if not src:
            return None
        return KVRegion(tuple(src), lay.layer_start, lay.layer_end), KVRegion(tuple(dst), lay.layer_start, lay.layer_end)

    def prefetch(self, key: object, region: int, seqs: list[SwapSeq]) -> None:
        with self._lock:
            self._ready[key] = threading.Event()
            self._region_of[key] = region
        self._queue.put((key, region, seqs))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, region, seqs = item
            self._free[region].wait()  # the previous step in this region has been written back
            with self._lock:
                if key not in self._region_of:  # dropped before its turn (a stale step, a reset)
                    continue
                self._free[region].clear()
            t0 = time.perf_counter()
            try:
                pair = self._regions(seqs, computed=True)
                if pair is not None and self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        transfer(self.host, pair[0], self.device, pair[1], self._in_staging)
                        done = torch.cuda.Event()
                        done.record(self._stream)
                    done.synchronize()
                elif pair is not None:
                    transfer(self.host, pair[0], self.device, pair[1], self._in_staging)
                    self.stats["swap_in_bytes"] += pair[0].num_tokens * 2 * self.host.layout.num_layers * \
                        self.host.layout.num_kv_heads * self.host.layout.head_dim * self.host.layout.dtype_bytes
            except BaseException as e:  # reported to the compute thread by wait()
                self._errors[key] = e
            self.stats["swap_in_s"] += time.perf_counter() - t0
            ev = self._ready.get(key)
            if ev is not None:
                ev.set()

    def wait(self, key: object) -> None:
        t0 = time.perf_counter()
        self._ready[key].wait()
        self.stats["wait_s"] += time.perf_counter() - t0
        err = self._errors.pop(key, None)
        if err is not None:
            raise err

    def write_back(self, seqs: list[SwapSeq]) -> None:
        t0 = time.perf_counter()
        pair = self._regions(seqs, computed=False)
        if pair is not None:
            transfer(self.device, pair[1], self.host, pair[0], self._out_staging)
            lay = self.host.layout
            self.stats["write_back_bytes"] += pair[0].num_tokens * 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * lay.dtype_bytes
        self.stats["write_back_s"] += time.perf_counter() - t0

    def done(self, key: object) -> None:
        with self._lock:
            self._ready.pop(key, None)
            self._errors.pop(key, None)
            region = self._region_of.pop(key, None)
            if region is not None:
                self._free[region].set()

    def forget_prefetched(self) -> None:
        """Forget every prefetched step (a recovery: they will not run). Swap-ins still queued run and are dropped."""
        for key in list(self._region_of):
            self.done(key)

    def close(self) -> None:
        self._queue.put(None)
        for e in self._free:
            e.set()
        self._thread.join(timeout=5.0)

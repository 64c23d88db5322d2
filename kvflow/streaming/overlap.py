"""Streaming an engine's KV while it runs: layer-by-layer for prompt tokens and one buffered chunk
per decode step, sent by a background thread so the transfer overlaps the following compute."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvflow.kv.cache import KVCache
from kvflow.model.batch import ForwardBatch
from kvflow.streaming.errors import StreamingError
from kvflow.streaming.primitives import OutStream, flush
from kvflow.streaming.region import KVRegion, SeqRegion
from kvflow.streaming.scatter import scatter
from kvflow.streaming.staging import Staging, StagingPool

StreamMode = Literal["naive", "buffered", "overlap"]
MODES = ("naive", "buffered", "overlap")


@dataclass(frozen=True)
class StreamerConfig:
    """naive: after each step, every contiguous piece is sent on the compute thread.
    buffered: after each step, all new KV is packed into one staging buffer and sent on the compute thread.
    overlap: prompt tokens are packed per layer as soon as the layer's KV is written, decode tokens
    once per step; a background thread sends them while compute continues (`pool_size` buffers in flight)."""

    mode: StreamMode = "overlap"
    pool_size: int = 4
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.pool_size <= 0 or self.timeout <= 0:
            raise ValueError("pool_size and timeout must be positive")


class KVStreamer:
    """Sends every token of KV a model writes into `cache` to `out`.

    Contract: call `begin_step(request_ids)` before each forward (ids in the batch's sequence
    order) and install `on_layer` as the model's layer hook; `finish()` returns once everything
    written so far has been sent and acknowledged, re-raising any background error. An error in
    the background thread is also re-raised by the next `on_layer`, so a dead peer stops the engine.
    `tables` keeps the latest block ids seen per request.
    """

    def __init__(self, cache: KVCache, out: OutStream, config: StreamerConfig = StreamerConfig()) -> None:
        self.cache = cache
        self.out = out
        self.config = config
        self.last_layer = cache.layout.layer_end - 1
        self.first_layer = cache.layout.layer_start
        self.tables: dict[str, tuple[int, ...]] = {}
        self._ids: list[str] = []
        self._staging = Staging(cache.device)
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._pool = StagingPool(config.pool_size, cache.device)
        self._thread: threading.Thread | None = None
        if config.mode == "overlap":
            self._thread = threading.Thread(target=self._sender, name="kv-streamer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ compute thread
    def begin_step(self, request_ids: Sequence[str]) -> None:
        self._raise_pending()
        self._ids = list(request_ids)

    def _regions(self, batch: ForwardBatch, prefill: bool | None) -> list[SeqRegion]:
        if len(self._ids) != len(batch.seqs):
            raise StreamingError(f"begin_step named {len(self._ids)} requests but the batch has {len(batch.seqs)}")
        out = []
        for rid, s in zip(self._ids, batch.seqs):
            self.tables[rid] = s.block_ids
            if prefill is None or (s.query_len > 1) == prefill:
                out.append(SeqRegion(rid, s.block_ids, s.context_len - s.query_len, s.context_len))
        return out

    def on_layer(self, layer: int, batch: ForwardBatch) -> None:
        """The LayerHook: runs right after `layer`'s new K/V are in the cache."""
        self._raise_pending()
        mode = self.config.mode
        if mode == "overlap":
            prompt = self._regions(batch, prefill=True)
            if prompt:
                self._enqueue(KVRegion(tuple(prompt), layer, layer + 1))
            if layer == self.last_layer:
                decode = self._regions(batch, prefill=False)
                if decode:
                    self._enqueue(KVRegion(tuple(decode), self.first_layer, self.last_layer + 1))
        elif layer == self.last_layer:
            region = KVRegion(tuple(self._regions(batch, None)), self.first_layer, self.last_layer + 1)
            scatter(self.cache, region, self.out, mode=mode, staging=self._staging)

    def _enqueue(self, region: KVRegion) -> None:
        try:
            staging = self._pool.acquire(timeout=self.config.timeout)
        except TimeoutError:
            self._raise_pending()
            raise StreamingError(f"KV streaming fell {self.config.pool_size} buffers behind for {self.config.timeout}s") from None
        data, event = staging.pack(self.cache, region, region.slot_tensor(self.cache.layout.block_size, self.cache.device))
        self._queue.put((staging, region, data, event))

    def finish(self) -> None:
        """Wait until all KV written so far is sent and acknowledged."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            while not done.wait(0.05):
                self._raise_pending()
                if not self._thread.is_alive():
                    break
        self._raise_pending()
        self.out.drain()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.config.timeout)

    def _raise_pending(self) -> None:
        if self._error is not None:
            err = self._error
            raise StreamingError(f"KV streaming failed: {type(err).__name__}: {err}") from err

    # ------------------------------------------------------------------ background thread
    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            staging, region, data, event = item
            try:
                if self._error is None:
                    if event is not None:
                        event.synchronize()
                    flush(self.out, region.desc, data)
            except BaseException as e:  # surfaced on the compute thread at its next hook call
                self._error = e
            finally:
                self._pool.release(staging)


def attach(engine, streamer: KVStreamer) -> None:
    """Make an `LLMEngine` stream through `streamer`: its runner's layer hook becomes
    `streamer.on_layer`, and each `runner.run` first tells the streamer which requests it runs."""
    runner = engine.runner
    if runner.hook is not None:
        raise ValueError("the engine's runner already has a layer hook")
    if runner.kv is not streamer.cache:
        raise ValueError("the streamer must read the engine's own KV cache")
    run = runner.run

    def run_and_stream(out):
        streamer.begin_step([s.request.request_id for s in out.seqs])
        return run(out)

    runner.hook = streamer.on_layer
    runner.run = run_and_stream

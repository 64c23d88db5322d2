"""Level 2 of DéjàVuLib: `scatter` a non-contiguous KV region as contiguous transfers (naive: one
per piece; buffered: packed into one staging buffer), and `gather` chunks into a destination cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kvflow.kv.cache import KVCache
from kvflow.streaming.chunk import CHUNK_BYTES, DTYPE_NAMES, ChunkDesc, Segment
from kvflow.streaming.errors import ChunkMismatch, DuplicateChunk
from kvflow.streaming.primitives import Chunk, InStream, OutStream, fetch, fetch_many, flush, flush_many
from kvflow.streaming.region import KVRegion, SeqRegion, contiguous_pieces, flat_layers, piece_view, unpack
from kvflow.streaming.staging import Staging

Mode = Literal["naive", "buffered"]
NAIVE_BATCH = 64  # naive pieces per flush_many


@dataclass(frozen=True)
class TransferStats:
    chunks: int
    nbytes: int


def split_layers(region: KVRegion, bytes_per_layer: int, max_chunk_bytes: int) -> list[KVRegion]:
    """Cut a region into layer ranges whose packed size stays within max_chunk_bytes."""
    per = max(1, max_chunk_bytes // max(1, bytes_per_layer))
    return [region.layers(a, min(a + per, region.layer_end)) for a in range(region.layer_start, region.layer_end, per)]


def scatter(
    cache: KVCache,
    region: KVRegion,
    out: OutStream,
    mode: Mode = "buffered",
    coalesce: bool = True,
    staging: Staging | None = None,
    max_chunk_bytes: int = CHUNK_BYTES,
    meta: dict | None = None,
) -> TransferStats:
    """Send `region` of `cache` through `out`.

    Contract: "naive" flushes every contiguous cache piece (per layer, K/V, sequence and block run;
    adjacent blocks merged when `coalesce`) as its own chunk straight from cache memory. "buffered"
    packs the region into one reusable staging buffer (the transport's own memory when it offers
    `reserve`, e.g. shared memory) and flushes it as one chunk, or as layer slices of at most
    `max_chunk_bytes` (default `chunk.CHUNK_BYTES`, sized to this machine's cache; a single
    layer larger than that still goes whole). Either way a `gather` on the other side reconstructs
    exactly the same KV. `meta` travels in every chunk's header. Returns how many chunks and payload
    bytes were sent.
    """
    lay = cache.layout
    chunks = nbytes = 0
    if mode == "naive":  # the pieces handed to the transport together (flush_many), NAIVE_BATCH at a time
        items = []
        for p in contiguous_pieces(region, lay.block_size, coalesce):
            s = region.seqs[p.seq]
            items.append((ChunkDesc((Segment(s.request_id, p.token_start, p.token_start + p.length),), p.layer, p.layer + 1, "kv"[p.kind]), piece_view(cache, p)))
        for i in range(0, len(items), NAIVE_BATCH):
            hs = flush_many(out, items[i : i + NAIVE_BATCH], meta)
            chunks, nbytes = chunks + len(hs), nbytes + sum(h.nbytes for h in hs)
        return TransferStats(chunks, nbytes)
    if mode != "buffered":
        raise ValueError(f"mode must be 'naive' or 'buffered', got {mode!r}")
    staging = staging or Staging(cache.device)
    slots = region.slot_tensor(lay.block_size)
    per_layer = 2 * region.num_tokens * lay.num_kv_heads * lay.head_dim * lay.dtype_bytes  # packed bytes per layer
    for part in split_layers(region, per_layer, max_chunk_bytes):
        shape = (part.layer_end - part.layer_start, 2, region.num_tokens, lay.num_kv_heads, lay.head_dim)
        room = out.sender.reserve(per_layer * shape[0]) if cache.device.type == "cpu" else None
        if room is not None:  # pack straight into transport memory: no extra copy on send
            data = room.view(lay.dtype).view(shape)
            torch.index_select(flat_layers(cache, part.layer_start, part.layer_end), 2, slots, out=data)
        else:
            data, event = staging.pack(cache, (part.layer_start, part.layer_end), slots)
            if event is not None:
                event.synchronize()
        h = flush(out, part.desc, data, meta)
        chunks, nbytes = chunks + 1, nbytes + h.nbytes
    return TransferStats(chunks, nbytes)


# A function giving the destination block ids that hold tokens [0, num_tokens) of a request.
BlockResolver = Callable[[str, int], list[int]]


@dataclass
class KVSink:
    """The destination of a stream: writes verified chunks into `cache`, at block ids given by
    `resolve(request_id, num_tokens)` (e.g. a KVCacheManager growing the request's table).

    `expect(request_id, layers, tokens)` declares a region that must arrive; then a chunk
    touching anything not expected, or anything already received, is rejected (ChunkMismatch /
    DuplicateChunk) before a single byte is written, and `complete` says when all has arrived.
    Without expectations every well-formed chunk for layers this cache holds is accepted.
    """

    cache: KVCache
    resolve: BlockResolver
    received: dict[str, np.ndarray] = field(default_factory=dict)  # rid -> bool[layers, 2, tokens]
    expected: dict[str, np.ndarray] = field(default_factory=dict)

    def expect(self, request_id: str, layer_start: int, layer_end: int, token_start: int, token_end: int) -> None:
        lay = self.cache.layout
        if not lay.layer_start <= layer_start < layer_end <= lay.layer_end or not 0 <= token_start < token_end:
            raise ValueError(f"cannot expect layers [{layer_start}, {layer_end}) tokens [{token_start}, {token_end}) in a cache of layers [{lay.layer_start}, {lay.layer_end})")
        m = self.expected.setdefault(request_id, np.zeros((lay.num_layers, 2, 0), dtype=bool))
        if m.shape[2] < token_end:
            m = np.concatenate([m, np.zeros((lay.num_layers, 2, token_end - m.shape[2]), dtype=bool)], axis=2)
        m[layer_start - lay.layer_start : layer_end - lay.layer_start, :, token_start:token_end] = True
        self.expected[request_id] = m

    @property
    def complete(self) -> bool:
        return self.complete_for(self.expected)

    def forget(self, request_id: str) -> None:
        """Drop what is expected of and was received for a request (done, finished or failed)."""
        self.expected.pop(request_id, None)
        self.received.pop(request_id, None)

    def complete_for(self, request_ids) -> bool:
        """Whether everything expected of these requests has arrived."""
        for rid in request_ids:
            m = self.expected[rid]
            got = self.received.get(rid, np.zeros((m.shape[0], 2, 0), dtype=bool))
            n = min(got.shape[2], m.shape[2])
            if m[:, :, n:].any() or not got[:, :, :n][m[:, :, :n]].all():
                return False
        return True

    def _check_shape(self, chunk: Chunk) -> None:
        """The chunk's dtype, heads, head size and layers fit this cache."""
        lay, h = self.cache.layout, chunk.header
        d = h.desc
        if h.shape[3:] != (lay.num_kv_heads, lay.head_dim) or DTYPE_NAMES[lay.dtype] != h.dtype:
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq} is {h.dtype} {h.shape}; this cache holds {DTYPE_NAMES[lay.dtype]} with heads/dim {(lay.num_kv_heads, lay.head_dim)}")
        if not lay.layer_start <= d.layer_start < d.layer_end <= lay.layer_end:
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq} has layers [{d.layer_start}, {d.layer_end}); this cache holds [{lay.layer_start}, {lay.layer_end})")

    def write_at(self, chunk: Chunk, slots: np.ndarray) -> None:
        """Copy a chunk into the cache at the flat `slots` it names (a replication increment: the
        sender's own block ids, which a replica shares), after the same shape checks as `write` and
        a bounds check of every slot; no expectations and no per-request state are involved."""
        self._check_shape(chunk)
        lay, h = self.cache.layout, chunk.header
        if len(slots) != h.desc.num_tokens:
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq} names {len(slots)} slots for {h.desc.num_tokens} tokens")
        if len(slots) and not (0 <= int(slots.min()) and int(slots.max()) < lay.num_blocks * lay.block_size):
            raise ChunkMismatch(f"chunk {h.stream}#{h.seq} names slots outside this cache's {lay.num_blocks} blocks")
        d = h.desc
        unpack(self.cache, d.layer_start, d.layer_end, d.kinds, torch.from_numpy(slots).to(self.cache.device), chunk.data)

    def _check(self, chunk: Chunk) -> list[tuple[Segment, np.ndarray]]:
        self._check_shape(chunk)
        lay, h = self.cache.layout, chunk.header
        d = h.desc
        ls = slice(d.layer_start - lay.layer_start, d.layer_end - lay.layer_start)
        ks = slice(0, 2) if d.kinds == "kv" else slice(int(d.kinds == "v"), int(d.kinds == "v") + 1)
        marks, seen = [], set()
        for seg in d.segments:
            if seg.request_id in seen:
                raise ChunkMismatch(f"chunk {h.stream}#{h.seq} names request {seg.request_id!r} twice")
            seen.add(seg.request_id)
            ts = slice(seg.token_start, seg.token_end)
            if self.expected:
                exp = self.expected.get(seg.request_id)
                if exp is None or exp.shape[2] < seg.token_end or not exp[ls, ks, ts].all():
                    raise ChunkMismatch(f"chunk {h.stream}#{h.seq}: {seg} layers [{d.layer_start}, {d.layer_end}) {d.kinds} is not expected here")
            got = self.received.get(seg.request_id)
            if got is not None and got.shape[2] >= seg.token_end and got[ls, ks, ts].any():
                raise DuplicateChunk(f"chunk {h.stream}#{h.seq}: {seg} layers [{d.layer_start}, {d.layer_end}) {d.kinds} was already received")
            marks.append((seg, (ls, ks, ts)))
        return marks

    def write(self, chunk: Chunk) -> None:
        """Validate against the cache and the expectations, then copy the chunk into the cache."""
        marks = self._check(chunk)
        lay, d = self.cache.layout, chunk.header.desc
        seqs = [SeqRegion(seg.request_id, tuple(self.resolve(seg.request_id, seg.token_end)), seg.token_start, seg.token_end) for seg, _ in marks]
        slots = KVRegion(tuple(seqs), d.layer_start, d.layer_end).slot_tensor(lay.block_size, self.cache.device)
        unpack(self.cache, d.layer_start, d.layer_end, d.kinds, slots, chunk.data)
        for seg, idx in marks:
            got = self.received.get(seg.request_id, np.zeros((lay.num_layers, 2, 0), dtype=bool))
            if got.shape[2] < seg.token_end:
                got = np.concatenate([got, np.zeros((lay.num_layers, 2, seg.token_end - got.shape[2]), dtype=bool)], axis=2)
            got[idx] = True
            self.received[seg.request_id] = got


def gather(inp: InStream, sink: KVSink, num_chunks: int | None = None, timeout: float = 10.0, until: Callable[[], bool] | None = None) -> TransferStats:
    """Receive chunks into `sink` until `until()` holds (default: the sink is `complete`), or until
    `num_chunks` arrived when that is given.

    Contract: every chunk is verified (fetch) and checked against the sink before it is written; a
    rejected chunk is reported back to its sender and its error raised here, leaving the cache
    untouched by it. TimeoutError when no chunk arrives for `timeout` seconds.
    """
    if num_chunks is None and not sink.expected:
        raise ValueError("gather needs num_chunks or a sink with expectations to know when to stop")
    done = until or (lambda: sink.complete)
    chunks = nbytes = 0
    while (num_chunks is None and not done()) or (num_chunks is not None and chunks < num_chunks):
        # a known count is fetched in batches; otherwise one at a time, so nothing past `until` is taken
        batch = fetch_many(inp, num_chunks - chunks, timeout) if num_chunks is not None else [fetch(inp, timeout)]
        for i, chunk in enumerate(batch):
            try:
                with chunk:
                    sink.write(chunk)
            except BaseException as e:
                for rest in batch[i + 1 :]:  # verified but not written: rejected, never dropped silently
                    rest.release(f"not written: chunk {chunk.header.stream}#{chunk.header.seq} before it failed ({type(e).__name__})")
                raise
            chunks, nbytes = chunks + 1, nbytes + chunk.header.nbytes
    return TransferStats(chunks, nbytes)


def table_resolver(tables: dict[str, list[int]], allocate: Callable[[list[int], int], bool]) -> BlockResolver:
    """A BlockResolver over per-request block tables grown by `allocate(table, num_tokens)`
    (e.g. `KVCacheManager.ensure`); raises when the destination cache is full."""

    def resolve(request_id: str, num_tokens: int) -> list[int]:
        table = tables.setdefault(request_id, [])
        if not allocate(table, num_tokens):
            raise ChunkMismatch(f"no free KV blocks at the destination for {request_id!r} ({num_tokens} tokens)")
        return table

    return resolve


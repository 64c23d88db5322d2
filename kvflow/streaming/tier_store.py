"""The executor side of the KV tiers: the host slots (a `KVCache` in host memory, pinned on CUDA) and
the disk slots (one chunk file per slot through the file transport, read back memory-mapped and
verified) of one worker or engine, and `apply(plan)`, which performs a step's `TierPlan` before the
step's forward. What moves is decided by the scheduler (`kvflow.kv.tiers`); bytes move only here,
with the streaming library's pieces: regions packed by `Staging` (coalesced: one pack and one unpack
per phase of a step), chunk headers with their XXH3 checksum, `FileSender.send_at` / `read_chunk_file`
and `verify` for the disk, `KVPuller` for blocks pulled from another instance (`kvflow.streaming.kv_pull`)."""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

import torch

from kvflow.kv.cache import KVCache
from kvflow.kv.tiers import DISK_SLOT_OVERHEAD, PHASES, TierPlan
from kvflow.streaming.chunk import ChunkDesc, Segment, encode_header, make_header, tensor_bytes
from kvflow.streaming.errors import ChunkError, ChunkMismatch
from kvflow.streaming.kv_pull import KVPuller
from kvflow.streaming.primitives import verify
from kvflow.streaming.region import KVRegion, SeqRegion, unpack
from kvflow.streaming.staging import Staging, transfer
from kvflow.streaming.transports.file import SUFFIX, FileSender, chunk_path, read_chunk_file

log = logging.getLogger(__name__)


class TierStore:
    """Host and disk slots of `cache`'s layers (`host_slots`, `disk_slots`; a disk needs a host tier).
    The disk store lives in `disk_path` (a fresh temporary directory when None); chunk files left
    there by an earlier process are deleted first, never trusted.

    Contract: `apply(plan)` performs the plan's copies in the order of `kv.tiers.PHASES` and returns
    the host slots of `plan.from_disk` whose disk block was rejected (unreadable, truncated, wrong
    checksum or shape): those slots hold nothing usable. `plan.from_remote` is pulled in the background
    (`puller`, with the API key of this deployment; one thread, pulls in order), while steps go on:
    `take_pulled` returns each finished pull with the host slots the instance did not send (it no longer
    holds them, or could not be reached). Only slots that are loading — pinned, read by nobody — are
    written by that thread. Every slot file stays within the KV bytes
    of a block plus `DISK_SLOT_OVERHEAD` (asserted), so the disk tier never exceeds its budget.
    `moved` counts bytes and seconds per phase."""

    def __init__(self, cache: KVCache, host_slots: int, disk_slots: int = 0, disk_path: str | None = None) -> None:
        if disk_slots and not host_slots:
            raise ValueError("a disk tier needs a host tier above it")
        self.cache = cache
        lay = cache.layout
        cuda = cache.device.type == "cuda"
        self.host = KVCache(replace(lay, num_blocks=host_slots), "cpu", pin_memory=cuda) if host_slots else None
        self.disk_slots = disk_slots
        self.files: FileSender | None = None
        if disk_slots:
            root = Path(disk_path) if disk_path else Path(tempfile.mkdtemp(prefix="kvflow-disk-kv-"))
            root.mkdir(parents=True, exist_ok=True)
            for p in list(root.glob(f"*{SUFFIX}")) + list(root.glob("*.tmp")):
                p.unlink()
            self.files = FileSender(root)
        self.slot_limit = lay.bytes_per_block + DISK_SLOT_OVERHEAD
        self._dev_staging = Staging(cache.device)
        self._host_staging = Staging("cpu")
        self._stream = f"tiers-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self.puller = KVPuller(lay) if host_slots else None
        self._pull_thread: ThreadPoolExecutor | None = None  # started by the first pull
        self._pulls: deque[tuple[list, Future]] = deque()
        self.moved = {ph: [0, 0.0] for ph in (*PHASES, "from_remote")}  # phase -> [bytes, seconds]

    @property
    def host_bytes(self) -> int:
        """Bytes the host slots occupy (within the host tier's budget: slots x a block's bytes)."""
        return self.host.data.numel() * self.host.data.element_size() if self.host is not None else 0

    @property
    def root(self) -> Path | None:
        return self.files.root if self.files is not None else None

    def apply(self, plan: TierPlan) -> list[int]:
        if not plan:
            return []
        failed: list[int] = []
        for ph in PHASES:
            ops = getattr(plan, ph)
            if not ops:
                continue
            t0 = time.perf_counter()
            if ph == "to_disk":
                self._to_disk(ops)
            elif ph == "to_host":
                self._copy(self.cache, [a for a, _ in ops], self.host, [b for _, b in ops], self._dev_staging)
            elif ph == "from_disk":
                failed = self._from_disk(ops)
            else:
                self._copy(self.host, [a for a, _ in ops], self.cache, [b for _, b in ops], self._host_staging)
            m = self.moved[ph]
            m[0] += len(ops) * self.cache.layout.bytes_per_block
            m[1] += time.perf_counter() - t0
        if plan.from_remote:
            if self._pull_thread is None:
                self._pull_thread = ThreadPoolExecutor(1, thread_name_prefix="kvflow-kv-pull")
            ops = list(plan.from_remote)
            self._pulls.append((ops, self._pull_thread.submit(self._from_remote, ops)))
        return failed

    @property
    def pulling(self) -> bool:
        """Whether a pull is in flight or finished and not yet taken."""
        return bool(self._pulls)

    def take_pulled(self) -> list[tuple[list[tuple[str, bytes, int]], list[int]]]:
        """The pulls finished since the last call, in the order they were planned: (their ops, the host slots of
        blocks that did not come)."""
        out = []
        while self._pulls and self._pulls[0][1].done():
            ops, fut = self._pulls.popleft()
            out.append((ops, fut.result()))
        return out

    def wait_pulls(self, timeout_s: float) -> None:
        """Block until the oldest pull in flight finishes, at most `timeout_s` (an engine with nothing else to do)."""
        if self._pulls:
            wait([self._pulls[0][1]], timeout_s)

    # ------------------------------------------------------------------ copies
    def _region(self, blocks: list[int]) -> KVRegion:
        lay = self.cache.layout
        return KVRegion((SeqRegion("tier", tuple(blocks), 0, len(blocks) * lay.block_size),), lay.layer_start, lay.layer_end)

    def _copy(self, src: KVCache, src_blocks: list[int], dst: KVCache, dst_blocks: list[int], staging: Staging) -> None:
        """Blocks of `src` into blocks of `dst`: one packed buffer (coalesced runs), one scatter into `dst`."""
        transfer(src, self._region(src_blocks), dst, self._region(dst_blocks), staging)

    def _desc(self, disk_slot: int) -> ChunkDesc:
        lay = self.cache.layout
        return ChunkDesc((Segment(f"slot{disk_slot}", 0, lay.block_size),), lay.layer_start, lay.layer_end, "kv")

    def _to_disk(self, ops: list[tuple[int, int]]) -> None:
        bs = self.cache.layout.block_size
        for s, f in ops:
            region = self._region([s])
            data, _ = self._host_staging.pack(self.host, (region.layer_start, region.layer_end), region.slot_tensor(bs))
            payload = tensor_bytes(data)
            header = make_header(self._stream, self._seq, self._desc(f), data, None, payload)
            self._seq += 1
            size = self.files.send_at(f, encode_header(header), payload)
            assert size <= self.slot_limit, f"disk slot file of {size} B exceeds its {self.slot_limit} B budget"

    def _from_disk(self, ops: list[tuple[int, int]]) -> list[int]:
        lay = self.cache.layout
        want = self._desc(0)
        failed = []
        for f, s in ops:
            def check(h, f=f):
                d = h.desc
                if ([(g.request_id, g.token_start, g.token_end) for g in d.segments] != [(f"slot{f}", 0, lay.block_size)]
                        or (d.layer_start, d.layer_end, d.kinds) != (want.layer_start, want.layer_end, "kv")
                        or h.shape[3:] != (lay.num_kv_heads, lay.head_dim) or h.torch_dtype != lay.dtype):
                    raise ChunkMismatch(f"disk slot {f} holds {d}, not this store's block")
            try:
                chunk = verify(read_chunk_file(chunk_path(self.files.root, f)), self.slot_limit, None, check)
            except (ChunkError, OSError):
                failed.append(s)
                continue
            with chunk:
                slots = self._region([s]).slot_tensor(lay.block_size)
                unpack(self.host, lay.layer_start, lay.layer_end, "kv", slots, chunk.data)
        return failed

    def _from_remote(self, ops: list[tuple[str, bytes, int]]) -> list[int]:
        """(The pull thread.) Pull blocks into host slots, one request per run of ops naming the same instance; the
        slots of blocks it did not send are returned (failed)."""
        t0 = time.perf_counter()
        lay = self.cache.layout
        failed: list[int] = []
        i = 0
        while i < len(ops):
            j = i
            while j < len(ops) and ops[j][0] == ops[i][0]:
                j += 1
            source, run = ops[i][0], ops[i:j]
            i = j
            try:
                got = self.puller.pull(source, [h for _, h, _ in run])
            except (ChunkError, OSError, ValueError) as e:
                log.warning("pulling %d KV blocks from %s failed (they are recomputed): %s", len(run), source, e)
                got = None
            held: list[int] = []
            if got is not None:
                held, chunk = got
                with chunk:
                    # numpy's copy into the host slots: no OpenMP team in this thread beside the engine thread's
                    src = chunk.data.view(torch.uint8).numpy()
                    dst = self.host.data.view(torch.uint8).numpy()
                    dst[:, :, [run[k][2] for k in held]] = src.reshape(*src.shape[:2], len(held), lay.block_size,
                                                                      *src.shape[3:])
            came = set(held)
            failed.extend(s for k, (_, _, s) in enumerate(run) if k not in came)
        m = self.moved["from_remote"]
        m[0] += (len(ops) - len(failed)) * lay.bytes_per_block
        m[1] += time.perf_counter() - t0
        return failed

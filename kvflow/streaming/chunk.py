"""The chunk: a compact binary header describing a KV tensor (requests, layers, tokens, dtype, shape, seq, xxh3-64 checksum) beside its raw bytes."""

from __future__ import annotations

import glob
import math
import struct
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from kvflow.streaming.errors import ChunkCorrupted, ChunkOversized, ChunkTruncated

FORMAT_VERSION = 2  # 1: msgpack headers
KINDS = ("kv", "k", "v")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Segment:
    """Tokens [token_start, token_end) of one request; a chunk's token axis is its segments concatenated."""

    request_id: str
    token_start: int
    token_end: int

    def __post_init__(self) -> None:
        if not 0 <= self.token_start < self.token_end:
            raise ValueError(f"bad token range [{self.token_start}, {self.token_end}) for {self.request_id!r}")

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class ChunkDesc:
    """What a chunk holds: K and/or V of layers [layer_start, layer_end) for `segments`.

    The payload is a dense tensor [num_layers, len(kinds), total_tokens, kv_heads, head_dim], i.e.
    described by geometry, not by the sender's block ids, so any destination layout can place it.
    """

    segments: tuple[Segment, ...]
    layer_start: int
    layer_end: int
    kinds: str = "kv"

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a chunk needs at least one segment")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if self.kinds not in KINDS:
            raise ValueError(f"kinds must be one of {KINDS}, got {self.kinds!r}")

    @cached_property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (self.num_layers, len(self.kinds), self.num_tokens, kv_heads, head_dim)


@dataclass(frozen=True)
class ChunkHeader:
    """Everything a receiver checks before touching a cache. `seq` numbers chunks within `stream`."""

    stream: str
    seq: int
    desc: ChunkDesc
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ChunkCorrupted(f"unknown dtype {self.dtype!r}")
        if len(self.shape) != 5 or self.shape[:3] != (self.desc.num_layers, len(self.desc.kinds), self.desc.num_tokens):
            raise ChunkCorrupted(f"shape {self.shape} does not match the described layers/kinds/tokens")
        expect = math.prod(self.shape) * DTYPES[self.dtype].itemsize
        if self.nbytes != expect:
            raise ChunkCorrupted(f"header says {self.nbytes} bytes but shape {self.shape} of {self.dtype} is {expect}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# The header, little-endian: a fixed part, then the stream id (UTF-8), the segments (each a fixed
# part and its request id), then `meta` (msgpack; nothing when empty). Sequence number and checksum,
# the two fields that change from one chunk of a transfer to the next, come first: the receiver
# decodes and validates the rest (the "body") once per distinct body and reuses it (`_BODIES`).
_TOP = struct.Struct("<B7xQQ")  # version, seq, checksum
_BODY = struct.Struct("<BBHIII5QQI")  # kinds, dtype, stream id length, segments, layer_start, layer_end, shape, nbytes, meta length
_SEG = struct.Struct("<HII")  # request id length, token_start, token_end
_DTYPE_LIST = tuple(DTYPES)
_BODIES: dict[bytes, tuple[ChunkHeader, int]] = {}  # body bytes -> (a validated header with seq and checksum 0, meta length)
_MAX_BODIES = 4096


def encode_header(h: ChunkHeader) -> bytes:
    d = h.desc
    stream = h.stream.encode()
    segs = b"".join(_SEG.pack(len(r := s.request_id.encode()), s.token_start, s.token_end) + r for s in d.segments)
    meta = msgpack.packb(h.meta) if h.meta else b""
    return (_TOP.pack(FORMAT_VERSION, h.seq, h.checksum)
            + _BODY.pack(KINDS.index(d.kinds), _DTYPE_LIST.index(h.dtype), len(stream), len(d.segments), d.layer_start, d.layer_end, *h.shape,
                         h.nbytes, len(meta))
            + stream + segs + meta)


def decode_header(raw: bytes | memoryview) -> ChunkHeader:
    """Parse a header; anything malformed raises ChunkCorrupted."""
    try:
        v, seq, digest = _TOP.unpack_from(raw)
    except struct.error as e:
        raise ChunkCorrupted(f"unreadable chunk header: {e}") from None
    if v != FORMAT_VERSION:
        raise ChunkCorrupted(f"chunk format version {v}, expected {FORMAT_VERSION}")
    body = bytes(raw[_TOP.size :])
    known = _BODIES.get(body)
    if known is None:
        known = _decode_body(body)
        if len(_BODIES) >= _MAX_BODIES:
            _BODIES.clear()
        _BODIES[body] = known
    proto, meta_len = known
    h = object.__new__(ChunkHeader)  # a copy of the validated prototype, without validating again
    h.__dict__.update(proto.__dict__, seq=seq, checksum=digest, meta=msgpack.unpackb(body[len(body) - meta_len :]) if meta_len else {})
    return h


def _decode_body(body: bytes) -> tuple[ChunkHeader, int]:
    try:
        kinds, dtype, slen, nsegs, l0, l1, *rest = _BODY.unpack_from(body)
        shape, nbytes, mlen = tuple(rest[:5]), rest[5], rest[6]
        at = _BODY.size
        stream = body[at : at + slen].decode()
        at += slen
        segs = []
        for _ in range(nsegs):
            rlen, a, b = _SEG.unpack_from(body, at)
            at += _SEG.size
            segs.append(Segment(body[at : at + rlen].decode(), a, b))
            at += rlen
        if at + mlen != len(body):
            raise ValueError(f"header of {len(body)} body bytes, fields account for {at + mlen}")
        meta = msgpack.unpackb(body[at:]) if mlen else {}
        if not isinstance(meta, dict):
            raise ValueError("meta is not a map")
        h = ChunkHeader(stream, 0, ChunkDesc(tuple(segs), l0, l1, KINDS[kinds]), _DTYPE_LIST[dtype], shape, nbytes, 0, meta)
    except ChunkCorrupted:
        raise
    except Exception as e:  # struct/msgpack errors, bad UTF-8, bad values
        raise ChunkCorrupted(f"unreadable chunk header: {e}") from e
    return h, mlen


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if not t.is_cpu:
        raise ValueError("chunk payloads must be host tensors (stage device KV through a pinned buffer)")
    if not t.is_contiguous():
        raise ValueError("chunk payloads must be contiguous (pack non-contiguous regions first)")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: view the bytes
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def checksum(payload: memoryview | bytes) -> int:
    """64-bit XXH3 of the payload: detects corruption like crc32 but hashes cache-resident data
    more than an order of magnitude faster than zlib.crc32 (benchmarks/transports.py; docs/results.md,
    2026-11-24 transports), and it is computed at both ends of every transfer."""
    return xxhash.xxh3_64_intdigest(payload)


def make_header(stream: str, seq: int, desc: ChunkDesc, data: torch.Tensor, meta: dict[str, Any] | None = None, payload: memoryview | None = None) -> ChunkHeader:
    """The header of `data` (whose byte view `payload` is, when the caller already has it)."""
    if data.dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported KV dtype {data.dtype}")
    shape = tuple(data.shape)
    return ChunkHeader(stream, seq, desc, DTYPE_NAMES[data.dtype], shape, data.numel() * data.element_size(), checksum(tensor_bytes(data) if payload is None else payload), meta or {})


def verify_payload(h: ChunkHeader, payload: memoryview | bytes, max_bytes: int) -> None:
    """Size and checksum checks; raises ChunkTruncated / ChunkOversized / ChunkCorrupted."""
    if h.nbytes > max_bytes:
        raise ChunkOversized(f"chunk {h.stream}#{h.seq} is {h.nbytes} bytes; the receiver accepts at most {max_bytes}")
    n = len(payload) if isinstance(payload, bytes) else payload.nbytes
    if n < h.nbytes:
        raise ChunkTruncated(f"chunk {h.stream}#{h.seq}: got {n} of {h.nbytes} payload bytes")
    if n > h.nbytes:
        raise ChunkOversized(f"chunk {h.stream}#{h.seq}: got {n} payload bytes, header says {h.nbytes}")
    got = checksum(payload)
    if got != h.checksum:
        raise ChunkCorrupted(f"chunk {h.stream}#{h.seq}: checksum {got:#010x} != header {h.checksum:#010x}")


def _last_level_cache_bytes() -> int | None:
    """The largest CPU cache (L3 on most servers) in bytes, from sysfs; None where it is not told."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes) if sizes else None


def preferred_chunk_bytes(cache_bytes: int | None = None) -> int:
    """The chunk size the library cuts regions to: the largest power of two within an eighth of the
    last-level cache, between 1 and 16 MB (4 MB on a 32 MB L3; 4 MB where the cache size is not
    known). A chunk's source, its destination and the chunks in flight then stay in cache. Past
    that copies run at DRAM speed: a memcpy into a chunk as large as half the L3 is several times
    slower than into one of 1-4 MB, and every transport, raw sockets included, slows down with it
    (docs/results.md, 2026-11-24 transports)."""
    cache_bytes = _last_level_cache_bytes() if cache_bytes is None else cache_bytes
    if not cache_bytes:
        return 4 << 20
    return min(16 << 20, max(1 << 20, 1 << ((cache_bytes // 8).bit_length() - 1)))


CHUNK_BYTES = preferred_chunk_bytes()

# torch warns about read-only buffers (ZeroMQ frames, read-only maps); chunk views are read-only by contract.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # numpy has no bfloat16: its bits as uint16


def payload_tensor(h: ChunkHeader, payload: memoryview | bytes) -> torch.Tensor:
    """A zero-copy tensor view of a verified payload (read-only memory: copy it out, never write)."""
    if h.nbytes == 0:
        return torch.empty(h.shape, dtype=h.torch_dtype)
    np_dtype = _NUMPY[h.dtype]
    t = torch.from_numpy(np.frombuffer(payload, dtype=np_dtype, count=h.nbytes // np.dtype(np_dtype).itemsize).reshape(h.shape))
    return t.view(torch.bfloat16) if h.dtype == "bfloat16" else t

"""Pulling a prompt's KV blocks from another instance by content hash (KVDirect's pull, between instances).

The router's P/D pools (`kvflow.router`) run a prompt on a prefill instance, then send the request on to a decode
instance naming the prefill instance as its `kv_source`. Before admitting it, the decode instance's scheduler plans a
load of the prompt's full blocks that no tier of its own holds (`KVCacheManager.prefetch`, `TierPlan.from_remote`).
Its engine's `TierStore` performs it on a thread of its own, while the engine steps on, with `KVPuller.pull`: one
HTTP POST to the source's `PULL_PATH` naming the blocks' hashes and this cache's geometry, answered by one chunk of
the streaming library (`kvflow.streaming.chunk`: header with XXH3 checksum, verified here before any byte reaches the
host tier) holding those of the blocks the source still holds, in order, their positions among the hashes in its
`meta` ("held"): one pull may carry the blocks of several requests, so a block one request lacks does not cost the
next request its own. Blocks the source no longer holds (evicted) are recomputed; nothing waits for them.

The source answers from its API's worker thread, not from its engine's: it copies the blocks out of the device cache
while the engine keeps stepping, then checks that none of them was evicted (and so possibly overwritten) meanwhile
(`KVCacheManager.still_held`, by each block's generation) and sends only the blocks that stayed intact — a full block's
KV is never written again until its block is evicted.
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Sequence
from urllib.parse import urlparse

import torch

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.streaming.chunk import DTYPE_NAMES, ChunkDesc, Segment, encode_header, make_header, tensor_bytes
from kvflow.streaming.errors import ChunkMismatch
from kvflow.streaming.primitives import Chunk, verify
from kvflow.streaming.transports.file import frame, parse_frame

PULL_PATH = "/kvflow/kv/pull"
MAX_PULL_BLOCKS = 4096  # hashes one pull may name
MAX_REQUEST_BYTES = MAX_PULL_BLOCKS * 80 + 4096  # a pull's JSON body: 64 hex digits per hash, quoted, plus the layout


def geometry(layout: KVLayout) -> dict:
    """What the two caches must agree on for a block to move as it is."""
    return {"block_size": layout.block_size, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "layer_start": layout.layer_start, "layer_end": layout.layer_end, "dtype": DTYPE_NAMES[layout.dtype]}


def parse_pull(body: bytes, layout: KVLayout) -> list[bytes]:
    """The block hashes a pull names; ValueError for a malformed body or another cache geometry than `layout`."""
    if len(body) > MAX_REQUEST_BYTES:
        raise ValueError(f"a pull body is at most {MAX_REQUEST_BYTES} bytes")
    try:
        msg = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"a pull body is JSON: {e}") from None
    if not isinstance(msg, dict) or set(msg) != {"hashes", "geometry"}:
        raise ValueError("a pull body is {\"hashes\": [...], \"geometry\": {...}}")
    if msg["geometry"] != geometry(layout):
        raise ValueError(f"this instance's KV blocks are {geometry(layout)}, the pull's {msg['geometry']}")
    hashes = msg["hashes"]
    if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_PULL_BLOCKS:
        raise ValueError(f"a pull names 1 to {MAX_PULL_BLOCKS} block hashes")
    try:
        out = [bytes.fromhex(h) for h in hashes]
    except (TypeError, ValueError):
        raise ValueError("block hashes are hex strings") from None
    if any(len(h) != len(out[0]) or not h for h in out):
        raise ValueError("block hashes have one length")
    return out


def read_blocks(cache: KVCache, manager: KVCacheManager, hashes: Sequence[bytes]) -> list | None:
    """The frame (parts to concatenate) of one chunk holding those of `hashes` whose blocks are in `manager`'s device
    pool and stayed intact while they were copied, in order, their positions in `hashes` as the chunk's
    `meta["held"]`; None when there is none. Safe beside the thread that owns `manager` and steps `cache` (see the
    module docstring)."""
    held = manager.held_blocks(hashes)
    if not held:
        return None
    lay = cache.layout
    blocks = [b for _, b, _ in held]
    if cache.device.type == "cpu":  # numpy's copy: no OpenMP team in this thread beside the engine thread's
        data = torch.from_numpy(cache.data.view(torch.uint8).numpy()[:, :, blocks]).view(lay.dtype)
    else:
        data = cache.data.index_select(2, torch.tensor(blocks, device=cache.device))
    intact = manager.still_held(hashes, held)  # [layers, 2, blocks, block_size, heads, dim], copied: still intact?
    if not all(intact):
        keep = [k for k, ok in enumerate(intact) if ok]
        if not keep:
            return None
        data, held = data[:, :, keep], [held[k] for k in keep]
    n = len(held)
    data = data.reshape(lay.num_layers, 2, n * lay.block_size, lay.num_kv_heads, lay.head_dim).to("cpu").contiguous()
    desc = ChunkDesc((Segment("pull", 0, n * lay.block_size),), lay.layer_start, lay.layer_end, "kv")
    payload = tensor_bytes(data)
    header = make_header(f"pull-{uuid.uuid4().hex[:8]}", 0, desc, data, {"held": [i for i, _, _ in held]}, payload)
    return frame(encode_header(header), payload)


class KVPuller:
    """Pulls blocks into a cache of `layout`'s geometry from other instances (`api_key`: sent as a bearer token,
    the instances of one deployment sharing theirs)."""

    def __init__(self, layout: KVLayout, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.layout, self.api_key, self.timeout_s = layout, api_key, timeout_s

    def pull(self, source: str, hashes: Sequence[bytes]) -> tuple[list[int], Chunk] | None:
        """(the positions in `hashes` of the blocks `source`, an instance's base URL, sent, the verified chunk holding
        them in that order, whole blocks: release it after copying), or None: it holds none of them. Raises when it
        cannot be reached or answers with something this cache cannot take (the blocks are then recomputed; the
        reason is in the exception's text for the caller's log)."""
        hashes = list(hashes)[:MAX_PULL_BLOCKS]
        lay = self.layout
        body = json.dumps({"hashes": [h.hex() for h in hashes], "geometry": geometry(lay)}).encode()
        url = urlparse(source)
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(url.hostname, url.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        limit = len(hashes) * lay.bytes_per_block + 64 * 1024
        try:
            conn.request("POST", PULL_PATH, body, headers)
            resp = conn.getresponse()
            if resp.status == 204:
                return None
            if resp.status != 200:
                raise ConnectionError(f"{source}{PULL_PATH} answered {resp.status}: {resp.read(512)!r}")
            data = bytearray(resp.read(limit + 1))  # (writable: the chunk's tensor is a view of it)
        finally:
            conn.close()
        if len(data) > limit:
            raise ChunkMismatch(f"{source} answered more than {limit} bytes for {len(hashes)} blocks")

        def check(h) -> None:
            d, held = h.desc, h.meta.get("held")
            if ((d.layer_start, d.layer_end, d.kinds) != (lay.layer_start, lay.layer_end, "kv")
                    or h.shape[3:] != (lay.num_kv_heads, lay.head_dim) or h.torch_dtype != lay.dtype
                    or not isinstance(held, list) or not held or d.num_tokens != len(held) * lay.block_size
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in held)
                    or held != sorted(set(held)) or held[0] < 0 or held[-1] >= len(hashes)):
                raise ChunkMismatch(f"{source} answered {d} {h.shape} {h.torch_dtype}, not blocks of this cache")

        chunk = verify(parse_frame(data, source), limit, None, check)
        return chunk.header.meta["held"], chunk


"""The wire's message authentication (`kvflow.wire`): a keyed BLAKE2b over a message's header and
tensor frame with the cluster's secret; a long tensor frame is MACed as leaves hashed in parallel."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

MAC_BYTES = 16
LEAF_BYTES = 1 << 20  # a tensor frame longer than this is MACed as leaves hashed in parallel


def mac(secret: bytes, header: bytes, payload) -> bytes:
    """Keyed BLAKE2b over the header and the tensor frame. A frame of more than `LEAF_BYTES` (a prompt
    chunk's hidden states: megabytes) is MACed as its leaves' keyed digests, each bound to its index and
    the frame's length, computed on a thread pool (hashlib lets go of the GIL while it hashes)."""
    view = memoryview(payload).cast("B") if payload is not None else None
    leaves = view is not None and len(view) > LEAF_BYTES
    h = hashlib.blake2b(key=secret, digest_size=MAC_BYTES, person=b"kvflow-leaves" if leaves else b"")
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    if leaves:
        h.update(len(view).to_bytes(8, "little"))
        parts = [view[i:i + LEAF_BYTES] for i in range(0, len(view), LEAF_BYTES)]
        for digest in _hash_pool().map(_leaf, [secret] * len(parts), range(len(parts)), parts):
            h.update(digest)
    elif view is not None:
        h.update(view)
    return h.digest()


def _leaf(secret: bytes, index: int, data: memoryview) -> bytes:
    return hashlib.blake2b(data, key=secret, digest_size=32, node_offset=index, node_depth=0).digest()


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """This process's MAC threads (made again in a forked child, where the parent's threads do not run)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="wire-mac"))
    return _POOL[1]

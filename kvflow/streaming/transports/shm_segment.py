"""The shared-memory transport's segment: its layout, the allocation of its data area, and the two
synchronisation primitives both sides use on it.

A segment is [control words | descriptor ring | data], created by one sender and mapped by its
receiver. The control words are counters and flags, the sender's and the receiver's on separate
cache lines; a descriptor (one cache line) announces one chunk: its sequence number, where its
payload and header lie in the data area, and, once the receiver released it, whether it was
accepted or rejected (the error text written over the header). The data area is handed out in
first-in first-out ranges (`Ring`).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import deque
from multiprocessing import shared_memory

import _posixshmem
import numpy as np

ALIGN = 64  # data ranges start on cache lines
DESCRIPTORS = 256  # descriptor ring entries: the most chunks in flight, whatever the window
ERROR_ROOM = 256  # a header takes at least this much room: a rejection's text is written over it
ADDRESS_PREFIX = "unix:@"  # a control address: the prefix, then a name in Linux's abstract namespace
SPIN_S = 250e-6  # how long a side that has to wait polls the segment before it sleeps (see `spin`)

# control words (int64), sender's and receiver's on separate cache lines
HEAD, TX_WAKE_AT = 0, 1  # written by the sender: descriptors published; RELEASED count it sleeps until (0: awake)
RX_SLEEPING, RELEASED = 8, 9  # written by the receiver: 1 while it blocks; descriptors released
CONTROL_WORDS = 16
# a descriptor (8 int64, one cache line): sequence number, payload range, header range, state, error length
SEQ, PAY_OFF, PAY_LEN, HEAD_OFF, HEAD_LEN, STATE, ERR_LEN = range(7)
PENDING, ACCEPTED, REJECTED = 0, 1, 2
DATA_START = (CONTROL_WORDS + 8 * DESCRIPTORS) * 8  # bytes before the data area


def control_views(buf) -> tuple[np.ndarray, np.ndarray]:
    """The control words [CONTROL_WORDS] and the descriptors [DESCRIPTORS, 8] of the segment in
    `buf`, as int64 views."""
    words = np.frombuffer(buf, dtype=np.int64, count=DATA_START // 8)
    return words[:CONTROL_WORDS], words[CONTROL_WORDS:].reshape(DESCRIPTORS, 8)


def sockaddr(address: str) -> str:
    """The Unix socket address of a control address (`ADDRESS_PREFIX` + name)."""
    if not address.startswith(ADDRESS_PREFIX):
        raise ValueError(f"not a shared-memory control address: {address!r} (expected {ADDRESS_PREFIX}NAME)")
    return "\0" + address[len(ADDRESS_PREFIX) :]  # Linux abstract namespace: nothing to clean up on disk


def attach(name: str) -> mmap.mmap:
    """Map the POSIX shared-memory segment `name` that another process created and owns.

    Mapped directly rather than through `multiprocessing.shared_memory.SharedMemory`: attaching that
    way registers the segment with the resource tracker (shared with its creator when spawned),
    which then unlinks or double-unregisters it. Its creator unlinks it. OSError (FileNotFoundError
    on another host) when there is no such segment."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def free_bytes() -> int | None:
    """What /dev/shm can still hold (None: no /dev/shm here)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment `name` of `nbytes`, owned by this process (registered with the resource tracker,
    so a killed owner's segment is still removed), with its memory reserved up front
    (`posix_fallocate`): OSError (ENOSPC) when /dev/shm cannot hold it, rather than a SIGBUS at
    the first write beyond its limit. The free room is checked first: tmpfs refuses only a request
    beyond its whole size at once, and fills the rest page by page before it gives up."""
    room = free_bytes()
    if room is None or nbytes > room:
        raise OSError(errno.ENOSPC, f"/dev/shm has {room or 0} bytes free, not {nbytes}")
    seg = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError:
        seg.close()
        seg.unlink()
        raise
    return seg


def release(seg: shared_memory.SharedMemory) -> None:
    """Unlink a segment `create` made and close its mapping; a mapping still viewed (a tensor over it
    somewhere) closes with its last view instead."""
    seg.unlink()
    try:
        seg.close()
    except BufferError:
        pass


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: the lock's atomic read-modify-write (a locked instruction on x86)
    orders this thread's earlier stores before its later loads, which x86-TSO alone does not."""
    _fence_lock.acquire()
    _fence_lock.release()


def spin(done, seconds: float = SPIN_S) -> bool:
    """Poll `done()` for up to `seconds`, yielding the core (and the GIL) between looks; whether
    it came true. A peer that keeps up is likelier to be a few tens of microseconds away than worth
    a wake-up (the other side's system call and this thread's wake, which on a loaded host cost
    more than copying a large chunk)."""
    until = time.monotonic() + seconds
    while not done():
        if time.monotonic() > until:
            return False
        os.sched_yield()
    return True


class Ring:
    """First-in first-out allocation of byte ranges in a segment of `size` bytes. A range is
    [offset, end, done]; space comes back once it and every range allocated before it are done.
    Allocation goes back to offset 0 as soon as there is room there, so a receiver that keeps up
    keeps the sender writing the same few (cached) ranges rather than walking the whole segment."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.head = 0
        self.live: deque[list] = deque()

    def alloc(self, n: int) -> list | None:
        n = -(-n // ALIGN) * ALIGN  # ranges start on cache lines
        if not self.live:
            self.head = 0
        tail = self.live[0][0] if self.live else self.size
        if self.live and self.head <= tail:  # wrapped: the free space is [head, tail)
            off = self.head if tail - self.head >= n else None
        elif tail >= n:  # free: [0, tail) and [head, size); the low end first, likelier in cache
            off = 0
        else:
            off = self.head if self.size - self.head >= n else None
        if off is None:
            return None
        r = [off, off + n, False]
        self.live.append(r)
        self.head = off + n
        return r

    def free(self, r: list) -> None:
        r[2] = True
        while self.live and self.live[0][2]:
            self.live.popleft()

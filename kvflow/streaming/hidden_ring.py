"""Hidden states from one pipeline stage to the next on one host, through a ring of slots in a
POSIX shared-memory segment instead of a tensor frame on the step message.

As a frame, a stage's output is copied to host memory (on CUDA, pageable: a staged copy), MACed
(keyed BLAKE2b over every byte), copied into and out of the sockets, MACed again and copied to the
device at the next stage: for a prompt chunk's megabytes of hidden states, milliseconds a hop.
Through the ring the sending stage copies its output into the next slot (on CUDA straight from the
device into memory registered with the driver, so a DMA both ways) and the step message names the
slot, dtype and shape (`Step.hidden`); the receiving stage reads it there.

The controller creates one ring per pair of adjacent stages whose processes it started on its own
host (`create_ring`); the receiving stage maps it at start-up and says so (`Ready.hidden_shm`), and only
then is the sending stage told to write into it (`Route.hidden_to`). A sender that cannot map it,
or an output bigger than a slot, falls back to the frame. A slot is reused once per `slots` sends,
and the controller keeps at most that many batches of the pipeline in flight
(`PipelineState.max_in_flight`): a batch's result comes back only after the receiving stage read
its input, so a slot is not overwritten while a live step may read it. A step a recovery voided can
read a slot already rewritten; its output is dropped by its epoch, and what it wrote into the KV cache
is redone by the steps after it.

Trust: the segment is the controller user's (mode 0600), as the replicas' are; the message naming
the slot is authenticated like any (`kvflow.wire`), and a descriptor that does not fit the ring is
refused (`ValueError`).
"""

from __future__ import annotations

import logging
import math
import uuid
from multiprocessing import shared_memory

import numpy as np
import torch

from kvflow.streaming.transports.shm_segment import ALIGN, attach, create
from kvflow.streaming.chunk import DTYPE_NAMES, DTYPES  # (the dtypes KV chunks carry, named as they name them)

log = logging.getLogger(__name__)

MAGIC = 0x6B76666C6F77_6869  # "kvflowhi": the segment is a hidden-state ring
HEADER = ALIGN  # [magic, slots, slot_bytes] as int64, then the slots, each on a cache line


def create_ring(slots: int, slot_bytes: int) -> shared_memory.SharedMemory:
    """A new ring of `slots` slots of `slot_bytes` each (rounded up to cache lines), owned by the
    caller (who unlinks it). OSError when /dev/shm cannot hold it (`shm_segment.create`)."""
    if slots <= 0 or slot_bytes <= 0:
        raise ValueError(f"a ring needs slots and room: {slots} slots of {slot_bytes} bytes")
    slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
    seg = create(f"kvflow-hidden-{uuid.uuid4().hex[:16]}", HEADER + slots * slot_bytes)
    np.frombuffer(seg.buf, dtype=np.int64, count=3)[:] = (MAGIC, slots, slot_bytes)
    return seg


class HiddenRing:
    """A ring mapped by a stage: the sender `put`s its output, the receiver `get`s it by descriptor.
    On CUDA (`device`), the mapping is registered with the driver (page-locked) where it can be."""

    def __init__(self, name: str, device: torch.device | str = "cpu") -> None:
        self.name = name
        self._mm = attach(name)
        magic, self.slots, self.slot_bytes = (int(v) for v in np.frombuffer(self._mm, dtype=np.int64, count=3))
        if magic != MAGIC or self.slots <= 0 or self.slot_bytes <= 0 or HEADER + self.slots * self.slot_bytes > len(self._mm):
            self._mm.close()
            raise ValueError(f"shared-memory segment {name} is not a hidden-state ring")
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.next = 0  # the slot the next `put` writes
        self.nbytes = 0  # bytes put so far
        self._registered = self._register(torch.device(device))

    def _register(self, device: torch.device) -> bool:
        """Page-lock the mapping for DMA to and from `device` (CUDA); False where it is not."""
        if device.type != "cuda":
            return False
        err = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0))
        if err:  # e.g. over the locked-memory limit: copies are staged by the driver instead
            log.warning("hidden-state ring %s: cudaHostRegister failed (%s); copies go through pageable memory", self.name, err)
            return False
        return True

    def put(self, t: torch.Tensor) -> list | None:
        """Copy `t` into the next slot; its descriptor for `Step.hidden`, or None when it does not
        fit (a dtype the ring does not carry, or more bytes than a slot): send it as a frame."""
        nbytes = t.numel() * t.element_size()
        if t.dtype not in DTYPE_NAMES or nbytes > self.slot_bytes:
            return None
        slot = self.next
        self.next = (slot + 1) % self.slots
        self._view(slot, t.dtype, tuple(t.shape)).copy_(t)  # (from CUDA: a synchronous copy, done on return)
        self.nbytes += nbytes
        return [slot, DTYPE_NAMES[t.dtype], *t.shape]

    def get(self, desc: list) -> torch.Tensor:
        """The tensor a descriptor from `put` names, in place in the ring (valid until its slot is
        reused). ValueError for a descriptor that does not fit this ring."""
        if len(desc) < 2 or type(desc[0]) is not int or desc[1] not in DTYPES or not all(type(d) is int and d >= 0 for d in desc[2:]):
            raise ValueError(f"bad hidden-state descriptor {desc!r}")
        slot, dtype, shape = desc[0], DTYPES[desc[1]], tuple(desc[2:])
        if not 0 <= slot < self.slots or math.prod(shape) * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"hidden-state descriptor {desc!r} does not fit ring {self.name} ({self.slots} x {self.slot_bytes} bytes)")
        return self._view(slot, dtype, shape)

    def _view(self, slot: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start = HEADER + slot * self.slot_bytes
        return self.data[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self._registered = False
        del self.data  # (the views go before the mapping)
        try:
            self._mm.close()
        except BufferError:  # a tensor read from it is still held: the mapping goes with it
            pass


def open_ring(name: str, device: torch.device | str, who: str) -> HiddenRing | None:
    """The ring `name` mapped here, or None (none named, or not mappable: logged)."""
    if not name:
        return None
    try:
        return HiddenRing(name, device)
    except (OSError, ValueError) as e:
        log.warning("%s: cannot map the hidden-state ring %s (%s); hidden states travel on the step messages", who, name, e)
        return None

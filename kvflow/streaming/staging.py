"""Reusable staging buffers for buffered copies: a region is packed into one dense buffer (on the
cache's device), then lands in host memory (pinned, copied on a side stream when on CUDA)."""

from __future__ import annotations

import math
import queue

import torch

from kvflow.kv.cache import KVCache
from kvflow.streaming.region import KVRegion, pack, unpack


class Staging:
    """One grow-only buffer. `pack(cache, layers, slots)` returns a host tensor [layers, 2, tokens,
    kv_heads, head_dim] and an event (None on CPU) to `wait()` on before reading it. The tensor
    stays valid until the next `pack` on this Staging."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.uint8)
        self.dev = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.event = None

    def _view(self, buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        nbytes = math.prod(shape) * dtype.itemsize
        if buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 2 * buf.numel()), dtype=torch.uint8, device=buf.device, pin_memory=pinned)
        return buf, buf[:nbytes].view(dtype).view(shape)

    def pack(self, cache: KVCache, layers: tuple[int, int], slots: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """K and V of `layers` [start, end) at the cache's flat `slots`, packed."""
        lay = cache.layout
        shape = (layers[1] - layers[0], 2, int(slots.numel()), lay.num_kv_heads, lay.head_dim)
        self.host, host = self._view(self.host, lay.dtype, shape, pinned=self.cuda)
        if not self.cuda:
            pack(cache, layers, slots, out=host)
            return host, None
        self.dev, dev = self._view(self.dev, lay.dtype, shape, pinned=False)
        pack(cache, layers, slots.to(self.device, non_blocking=True), out=dev)
        # Device -> pinned host on a side stream, so the copy overlaps the next kernels.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
            dev.record_stream(self.stream)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        return host, self.event


class StagingPool:
    """A fixed set of Staging buffers; `acquire` blocks while all are in flight (back-pressure)."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        self._free: queue.Queue[Staging] = queue.Queue()
        for _ in range(size):
            self._free.put(Staging(device))

    def acquire(self, timeout: float | None = None) -> Staging:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no staging buffer freed within {timeout}s") from None

    def release(self, staging: Staging) -> None:
        self._free.put(staging)


def transfer(src: KVCache, src_region: KVRegion, dst: KVCache, dst_region: KVRegion, staging: Staging) -> None:
    """Copy a region of `src` into `dst` at another region of the same shape (tokens in the same
    order, other block ids): one packed buffer (`staging`, on `src`'s device; through pinned host
    memory on a side stream when `src` is on CUDA), one scatter into `dst`. The copy mechanism of the
    KV tiers and of microbatch swapping."""
    if src_region.num_tokens != dst_region.num_tokens:
        raise ValueError(f"regions of {src_region.num_tokens} and {dst_region.num_tokens} tokens")
    bs = src.layout.block_size
    data, event = staging.pack(src, (src_region.layer_start, src_region.layer_end), src_region.slot_tensor(bs))
    if event is not None:
        event.synchronize()
    unpack(dst, dst_region.layer_start, dst_region.layer_end, "kv", dst_region.slot_tensor(bs, dst.device), data)

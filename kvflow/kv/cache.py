"""Paged KV storage for a contiguous range of layers, addressed by (layer, block, offset)."""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Protocol

import torch


class ModelShape(Protocol):
    """What a cache needs to know of a model (e.g. `kvflow.model.config.ModelConfig`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a paged KV cache holding layers [layer_start, layer_end).

    Storage is one tensor of shape [num_local_layers, 2 (K, V), num_blocks, block_size,
    num_kv_heads, head_dim]: for a given layer, one block of K (or V) is a contiguous run of
    `block_size * num_kv_heads * head_dim` elements, so "request r, layers i..j, tokens a..b"
    is a list of contiguous per-(layer, K/V, block) pieces.
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_start: int
    layer_end: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive ({self.num_blocks}, {self.block_size})")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")

    @classmethod
    def for_model(
        cls,
        cfg: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        layer_range: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> "KVLayout":
        start, end = layer_range or (0, cfg.num_layers)
        if end > cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) exceeds the model's {cfg.num_layers} layers")
        return cls(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, start, end, dtype)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_numel(self) -> int:
        """Elements in one block of K (or V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id occupies across all local layers, K and V."""
        return 2 * self.num_layers * self.block_numel * self.dtype_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


HUGE_PAGE = 2 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the kernel zeroes when they are first touched: a private
    anonymous mapping reads as zeros by POSIX's guarantee, so a large cache costs nothing at start
    (`torch.zeros` writes every page: about 1.5 s per GB) and only the blocks in use become resident.
    Like PyTorch's own allocations of 2 MB or more under THP_MEM_ALLOC_ENABLE=1 (`kvflow/__init__.py`),
    the mapping starts on a 2 MB boundary and is madvised onto transparent huge pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):  # (small, or no POSIX mmap: Windows)
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped when the last view goes
    start = -flat.data_ptr() % HUGE_PAGE
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return flat[start : start + nbytes].view(dtype).view(shape)


class KVCache:
    """The KV tensors of one worker (or one engine): see `KVLayout` for the geometry."""

    shared = False  # its tensor is another object's buffer (`over`), e.g. shared memory

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.layout = layout
        self.device = torch.device(device)
        if self.device.type == "cpu" and not pin_memory:
            self.data = lazy_zeros(layout.shape, layout.dtype)
        else:  # pinned host memory comes from the CUDA allocator; on a device, zeros is one memset kernel
            self.data = torch.zeros(layout.shape, dtype=layout.dtype, device=self.device, pin_memory=pin_memory)

    @classmethod
    def over(cls, layout: KVLayout, buffer) -> "KVCache":
        """A host cache whose tensor is the start of `buffer` (writable, e.g. a shared-memory
        mapping two processes hold: the replica store's), not a copy of it. ValueError when the
        buffer is too small for the layout."""
        nbytes, have = math.prod(layout.shape) * layout.dtype.itemsize, len(memoryview(buffer).cast("B"))
        if have < nbytes:
            raise ValueError(f"a buffer of {have} bytes cannot hold a cache of {nbytes}")
        cache = cls.__new__(cls)
        cache.layout, cache.device = layout, torch.device("cpu")
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
        cache.data, cache.shared = flat.view(layout.dtype).view(layout.shape), True
        return cache

    def _local(self, layer: int) -> int:
        if not self.layout.layer_start <= layer < self.layout.layer_end:
            raise IndexError(f"layer {layer} not held here [{self.layout.layer_start}, {self.layout.layer_end})")
        return layer - self.layout.layer_start

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of a global layer index, each [num_blocks, block_size, kv_heads, head_dim]."""
        i = self._local(layer)
        return self.data[i, 0], self.data[i, 1]

    def layer_kv(self, layer: int) -> torch.Tensor:
        """K and V of a global layer index as one view [2, num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[self._local(layer)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at flat slots (block * block_size + offset)."""
        kc, vc = self.layer(layer)
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))

    def read(self, layer: int, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens` K and V of a sequence, gathered into [num_tokens, kv_heads, head_dim]."""
        kc, vc = self.layer(layer)
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        k = kc.index_select(0, idx).flatten(0, 1)[:num_tokens]
        v = vc.index_select(0, idx).flatten(0, 1)[:num_tokens]
        return k, v

"""KV regions in block layout: which slots a (requests, layers, tokens) region covers, its contiguous
pieces (adjacent blocks coalesced), and packing it into / unpacking it from one dense buffer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow.kv.cache import KVCache
from kvflow.streaming.chunk import ChunkDesc, Segment


@dataclass(frozen=True)
class SeqRegion:
    """Tokens [token_start, token_end) of one request whose KV lives in `block_ids` (in order)."""

    request_id: str
    block_ids: tuple[int, ...]
    token_start: int
    token_end: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        if not 0 <= self.token_start < self.token_end:
            raise ValueError(f"bad token range [{self.token_start}, {self.token_end}) for {self.request_id!r}")

    @property
    def segment(self) -> Segment:
        return Segment(self.request_id, self.token_start, self.token_end)

    def slots(self, block_size: int) -> list[int]:
        return token_slots(self.block_ids, self.token_start, self.token_end, block_size, self.request_id)


def token_slots(block_ids: Sequence[int], token_start: int, token_end: int, block_size: int, name: str = "") -> list[int]:
    """The flat cache slots (block id * block_size + offset) of tokens [token_start, token_end) of a
    sequence whose KV lives in `block_ids`, in token order; one range per block touched."""
    if len(block_ids) * block_size < token_end:
        raise ValueError(f"{name!r}: {len(block_ids)} blocks cannot hold token {token_end - 1}")
    out: list[int] = []
    t = token_start
    while t < token_end:
        b, off = divmod(t, block_size)
        base = int(block_ids[b]) * block_size + off
        n = min(block_size - off, token_end - t)
        out.extend(range(base, base + n))
        t += n
    return out


@dataclass(frozen=True)
class KVRegion:
    """K and V of layers [layer_start, layer_end) for several sequences' token ranges."""

    seqs: tuple[SeqRegion, ...]
    layer_start: int
    layer_end: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "seqs", tuple(self.seqs))
        if not self.seqs:
            raise ValueError("a region needs at least one sequence")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")

    @property
    def num_tokens(self) -> int:
        return sum(s.token_end - s.token_start for s in self.seqs)

    @property
    def desc(self) -> ChunkDesc:
        return ChunkDesc(tuple(s.segment for s in self.seqs), self.layer_start, self.layer_end, "kv")

    def layers(self, layer_start: int, layer_end: int) -> "KVRegion":
        return KVRegion(self.seqs, layer_start, layer_end)

    def slot_tensor(self, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        slots = [x for s in self.seqs for x in s.slots(block_size)]
        return torch.tensor(slots, dtype=torch.long, device=device)


@dataclass(frozen=True)
class Piece:
    """A contiguous run in the cache: `length` tokens of (layer, kind) starting at flat slot `slot`,
    which are tokens [token_start, token_start + length) of sequence `seq` of the region."""

    layer: int
    kind: int  # 0 = K, 1 = V
    slot: int
    length: int
    seq: int
    token_start: int


def contiguous_pieces(region: KVRegion, block_size: int, coalesce: bool = True) -> list[Piece]:
    """The region as contiguous cache runs. Runs never cross a block boundary unless `coalesce`
    and the next block id is the adjacent one (KVDirect-style coalescing)."""
    runs: list[tuple[int, int, int, int]] = []  # (seq, slot, length, token_start)
    for i, s in enumerate(region.seqs):
        t = s.token_start
        while t < s.token_end:
            b, off = divmod(t, block_size)
            n = min(block_size - off, s.token_end - t)
            slot = s.block_ids[b] * block_size + off
            last = runs[-1] if runs else None
            if coalesce and last and last[0] == i and last[1] + last[2] == slot:
                runs[-1] = (i, last[1], last[2] + n, last[3])
            else:
                runs.append((i, slot, n, t))
            t += n
    return [
        Piece(layer, kind, slot, n, i, t0)
        for layer in range(region.layer_start, region.layer_end)
        for kind in (0, 1)
        for i, slot, n, t0 in runs
    ]


def flat_layers(cache: KVCache, layer_start: int, layer_end: int) -> torch.Tensor:
    """Layers [layer_start, layer_end) of the cache as a [layers, 2, slots, kv_heads, head_dim] view."""
    lay = cache.layout
    if not lay.layer_start <= layer_start < layer_end <= lay.layer_end:
        raise IndexError(f"layers [{layer_start}, {layer_end}) not held by this cache [{lay.layer_start}, {lay.layer_end})")
    a, b = layer_start - lay.layer_start, layer_end - lay.layer_start
    return cache.data[a:b].view(b - a, 2, lay.num_blocks * lay.block_size, lay.num_kv_heads, lay.head_dim)


def piece_view(cache: KVCache, p: Piece) -> torch.Tensor:
    """The cache memory of one piece, as a contiguous [1, 1, length, kv_heads, head_dim] view (no copy)."""
    return flat_layers(cache, p.layer, p.layer + 1)[:, p.kind : p.kind + 1, p.slot : p.slot + p.length]


def pack(cache: KVCache, layers: tuple[int, int], slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy K and V of `layers` [start, end) at `slots` into one dense [layers, 2, tokens, kv_heads,
    head_dim] tensor (`out` if given)."""
    src = flat_layers(cache, *layers)
    if out is None:
        return src.index_select(2, slots)
    torch.index_select(src, 2, slots, out=out)
    return out


def unpack(cache: KVCache, layer_start: int, layer_end: int, kinds: str, slots: torch.Tensor, data: torch.Tensor) -> None:
    """Write a dense [layers, kinds, tokens, kv_heads, head_dim] tensor into the cache at `slots`."""
    dst = flat_layers(cache, layer_start, layer_end)
    if kinds != "kv":
        k = 0 if kinds == "k" else 1
        dst = dst[:, k : k + 1]
    dst.index_copy_(2, slots, data.to(device=dst.device, dtype=dst.dtype))

"""Level 3 of DéjàVuLib: `plan_transfers` and `stream_out` between pipelines of different shapes —
which layers of which requests go from each source stage to each destination stage, splitting or
merging layer ranges (depth mismatch) and microbatches (batch-size mismatch). The receiving side is
the KV connector's `KVReceiver` (`connector.py`), which expects exactly the planned region."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvflow.kv.cache import KVCache
from kvflow.streaming.primitives import OutStream
from kvflow.streaming.region import KVRegion, SeqRegion
from kvflow.streaming.scatter import Mode, TransferStats, scatter


@dataclass(frozen=True)
class PipelineTopology:
    """Stage i holds layers [layer_bounds[i], layer_bounds[i+1]); requests, in a fixed global
    order, are cut into consecutive microbatches of `microbatch_sizes`."""

    layer_bounds: tuple[int, ...]
    microbatch_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_bounds", tuple(self.layer_bounds))
        object.__setattr__(self, "microbatch_sizes", tuple(self.microbatch_sizes))
        b = self.layer_bounds
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"layer_bounds must start at 0 and strictly increase, got {b}")
        if not self.microbatch_sizes or any(m <= 0 for m in self.microbatch_sizes):
            raise ValueError(f"microbatch sizes must be positive, got {self.microbatch_sizes}")

    @classmethod
    def even(cls, num_layers: int, depth: int, microbatch_sizes: Sequence[int]) -> "PipelineTopology":
        """`depth` stages with layer counts differing by at most one (earlier stages get the extra)."""
        if not 1 <= depth <= num_layers:
            raise ValueError(f"depth must be in [1, {num_layers}], got {depth}")
        q, r = divmod(num_layers, depth)
        bounds = [0]
        for i in range(depth):
            bounds.append(bounds[-1] + q + (i < r))
        return cls(tuple(bounds), tuple(microbatch_sizes))

    @property
    def depth(self) -> int:
        return len(self.layer_bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.layer_bounds[-1]

    @property
    def num_requests(self) -> int:
        return sum(self.microbatch_sizes)

    def stage_layers(self, stage: int) -> tuple[int, int]:
        return self.layer_bounds[stage], self.layer_bounds[stage + 1]

    def microbatch_requests(self, mb: int) -> tuple[int, int]:
        start = sum(self.microbatch_sizes[:mb])
        return start, start + self.microbatch_sizes[mb]


@dataclass(frozen=True)
class Transfer:
    """Layers [layer_start, layer_end) of requests [request_start, request_end) (global order)
    go from source stage `src` to destination stage `dst`."""

    src: int
    dst: int
    layer_start: int
    layer_end: int
    request_start: int
    request_end: int
    src_microbatch: int
    dst_microbatch: int


def plan_transfers(src: PipelineTopology, dst: PipelineTopology) -> list[Transfer]:
    """Every (layer range x request range) intersection of a source stage/microbatch with a
    destination stage/microbatch. The transfers cover each (layer, request) exactly once."""
    if src.num_layers != dst.num_layers:
        raise ValueError(f"source has {src.num_layers} layers, destination {dst.num_layers}")
    if src.num_requests != dst.num_requests:
        raise ValueError(f"source microbatches hold {src.num_requests} requests, destination {dst.num_requests}")
    plan = []
    for s in range(src.depth):
        sa, sb = src.stage_layers(s)
        for d in range(dst.depth):
            da, db = dst.stage_layers(d)
            la, lb = max(sa, da), min(sb, db)
            if la >= lb:
                continue
            for ms in range(len(src.microbatch_sizes)):
                ra, rb = src.microbatch_requests(ms)
                for md in range(len(dst.microbatch_sizes)):
                    qa, qb = dst.microbatch_requests(md)
                    if max(ra, qa) < min(rb, qb):
                        plan.append(Transfer(s, d, la, lb, max(ra, qa), min(rb, qb), ms, md))
    return plan


def stream_out(
    stage: int,
    cache: KVCache,
    requests: Sequence[SeqRegion],
    plan: Sequence[Transfer],
    outs: Mapping[int, OutStream],
    mode: Mode = "buffered",
    layers: tuple[int, int] | None = None,
    meta: dict | None = None,
) -> dict[int, TransferStats]:
    """Send this source stage's part of `plan` (only its layers within `layers`, when given: a
    layer-by-layer sender calls it once per layer as the layer's KV is written).

    Contract: `requests[i]` is the i-th request of the global order with its block ids in `cache`
    and the token range to send; `outs[d]` reaches destination stage d. Each transfer becomes one
    scatter of (its requests, its layers), with `meta` in its chunks. Returns per-destination totals.
    """
    totals: dict[int, TransferStats] = {}
    for t in plan:
        if t.src != stage:
            continue
        la, lb = t.layer_start, t.layer_end
        if layers is not None:
            la, lb = max(la, layers[0]), min(lb, layers[1])
            if la >= lb:
                continue
        if t.dst not in outs:
            raise KeyError(f"no stream to destination stage {t.dst}")
        region = KVRegion(tuple(requests[t.request_start : t.request_end]), la, lb)
        st = scatter(cache, region, outs[t.dst], mode=mode, meta=meta)
        prev = totals.get(t.dst, TransferStats(0, 0))
        totals[t.dst] = TransferStats(prev.chunks + st.chunks, prev.nbytes + st.nbytes)
    return totals

"""Whether a decode step's layers take the fused projections (`triton_fused_linear`), chosen per row
count when a model loads on CUDA (`choose`), by measuring both on this device.

A candidate is the part of a step the two paths differ in: every layer's residual add and norm then
qkv projection, the same before gate_up, and SiLU x up then down; separate kernels (`triton_fused`,
then cuBLAS through `Linear`) against fused ones. Each is captured in a CUDA graph, as decode steps
run, and timed by replaying it between CUDA events: the GPU's time without the host's launch gaps,
which is what a graphed step pays. The fused path is taken at a row count only where it measured
faster, so on a card where cuBLAS's GEMV wins nothing changes. Before timing, the fused kernels'
output is checked against the separate ones' on the device; a mismatch (or a kernel that fails to
build) leaves the fused path off, with a warning.

Row counts are measured at `FUSED_ROWS`; one between two measured ones takes the lower one's choice,
and above the last the separate kernels run. Prompt steps never take the fused path, nor does a
`deterministic` model (its projections are `triton_invariant`'s, batch-invariant).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from kvflow.model.llama import LayerWeights

log = logging.getLogger(__name__)

FUSED_ROWS = (1, 2, 4, 8, 16)  # decode row counts measured (the small CUDA graph buckets)
REPLAYS, PASSES = 10, 5  # a pass replays a graph REPLAYS times; a candidate's time is its best pass
TOLERANCE = 1e-2  # the device check: largest difference over the largest magnitude of the separate path's output


class Measurement(NamedTuple):
    rows: int
    separate_us: float  # GPU time of a step's norms, SiLU and the three projections they feed, separate kernels
    fused_us: float  # the same work in the fused kernels


@dataclass(frozen=True)
class FusionChoice:
    """The row counts whose decode steps take the fused projections, and what was measured to choose them."""

    rows: frozenset[int] = frozenset()
    measured: tuple[Measurement, ...] = ()
    why: str = "not measured"  # how the choice was made (for logs and benchmarks)

    def takes(self, rows: int) -> bool:
        return rows in self.rows


def choose(layers: list[LayerWeights], eps: float) -> FusionChoice:
    """The choice for a model's layers on their CUDA device (see the module). `KVFLOW_FUSED_PROJECTIONS`
    "0" or "1" sets it without measuring: never, or at every row count up to `FUSED_ROWS[-1]`.
    Cached per device, dtype and layer shapes."""
    forced = os.environ.get("KVFLOW_FUSED_PROJECTIONS")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"KVFLOW_FUSED_PROJECTIONS must be 0 or 1, not {forced!r}")
    if forced:
        return FusionChoice(frozenset(range(1, FUSED_ROWS[-1] + 1)) if forced == "1" else frozenset(),
                            why=f"KVFLOW_FUSED_PROJECTIONS={forced}")
    from kvflow.model import triton_fused_linear as fl

    first = layers[0]
    if not (fl.supported(first.qkv.weight.shape[1]) and fl.supported(first.down.weight.shape[1])):
        return FusionChoice(why="too wide for the fused kernels")
    key = (first.input_norm.device, first.input_norm.dtype, len(layers), first.qkv.weight.shape, first.gate_up.weight.shape)
    if key not in _CHOSEN:
        try:
            _CHOSEN[key] = _measure(layers, eps)
        except Exception as e:  # (Triton's compile and resource errors are not RuntimeErrors) a path that does not build is no candidate
            log.warning("the fused decode projections failed on this device (%s: %s); the separate kernels run",
                        type(e).__name__, e)
            _CHOSEN[key] = FusionChoice(why=f"failed: {type(e).__name__}")
    return _CHOSEN[key]


_CHOSEN: dict[tuple, FusionChoice] = {}


def _separate(layers: list[LayerWeights], x: torch.Tensor, delta: torch.Tensor, gate_up: torch.Tensor, eps: float):
    """The separate kernels' sequence, every layer; `x` is zeros, so the in-place residual add leaves `delta` as it was."""
    from kvflow.model import triton_fused as tf

    return [(lw.qkv(tf.add_rms_norm(delta, x, lw.input_norm, eps)), lw.gate_up(tf.add_rms_norm(delta, x, lw.post_norm, eps)),
             lw.down(tf.silu_mul(gate_up))) for lw in layers]


def _fused(layers: list[LayerWeights], x: torch.Tensor, delta: torch.Tensor, gate_up: torch.Tensor, eps: float):
    from kvflow.model import triton_fused_linear as fl

    return [(fl.add_norm_linear(x, delta, lw.input_norm, lw.qkv.weight, eps)[1],
             fl.add_norm_linear(x, delta, lw.post_norm, lw.gate_up.weight, eps)[1],
             fl.silu_linear(gate_up, lw.down.weight)) for lw in layers]


def _agree(layer: LayerWeights, rows: int, eps: float) -> bool:
    """Whether the fused kernels give the separate ones' values for one layer at `rows` rows (random inputs)."""
    from kvflow.model import triton_fused as tf
    from kvflow.model import triton_fused_linear as fl

    dtype, device = layer.input_norm.dtype, layer.input_norm.device
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(rows, layer.qkv.weight.shape[1], generator=g).to(dtype=dtype, device=device) for _ in range(2))
    gate_up = torch.randn(rows, layer.gate_up.weight.shape[0], generator=g).to(dtype=dtype, device=device)
    summed = delta.clone()
    want = [layer.qkv(tf.add_rms_norm(summed, x, layer.input_norm, eps)), layer.down(tf.silu_mul(gate_up))]
    s, qkv = fl.add_norm_linear(x, delta, layer.input_norm, layer.qkv.weight, eps)
    got = [qkv, fl.silu_linear(gate_up, layer.down.weight)]
    return torch.equal(s, summed) and all(
        float((a.float() - b.float()).abs().max()) <= TOLERANCE * float(b.float().abs().max()) for a, b in zip(got, want))


def _capture(fn, device: torch.device) -> torch.cuda.CUDAGraph:
    """`fn` run once eagerly (Triton compiles, cuBLAS picks its kernel), then captured, on a side stream as capture requires."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def _replay_us(graphs: list[torch.cuda.CUDAGraph]) -> list[float]:
    """Each graph's GPU microseconds per replay: the best of `PASSES` passes, the graphs interleaved
    (another process on the device can only make a pass slower)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = [math.inf] * len(graphs)
    for _ in range(PASSES):
        for i, graph in enumerate(graphs):
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            end.synchronize()
            best[i] = min(best[i], 1e3 * start.elapsed_time(end) / REPLAYS)
    return best


@torch.inference_mode()
def _measure(layers: list[LayerWeights], eps: float) -> FusionChoice:
    first = layers[0]
    device, dtype = first.input_norm.device, first.input_norm.dtype
    if not all(_agree(first, rows, eps) for rows in (1, FUSED_ROWS[-1])):
        log.warning("the fused decode projections disagree with the separate kernels on this device; the separate kernels run")
        return FusionChoice(why="disagreed with the separate kernels")
    measured, g = [], torch.Generator().manual_seed(0)  # (not the device's generator: sampling may use it)
    for rows in FUSED_ROWS:
        x = torch.zeros(rows, first.qkv.weight.shape[1], dtype=dtype, device=device)
        delta = torch.randn(rows, x.shape[1], generator=g).to(dtype=dtype, device=device)
        gate_up = torch.randn(rows, first.gate_up.weight.shape[0], generator=g).to(dtype=dtype, device=device)
        graphs = [_capture(lambda f=f: f(layers, x, delta, gate_up, eps), device) for f in (_separate, _fused)]
        measured.append(Measurement(rows, *_replay_us(graphs)))
        del graphs
    chosen = rows_chosen(measured)
    log.info("fused decode projections at rows %s (measured %s)", sorted(chosen), measured)
    return FusionChoice(chosen, tuple(measured), why="measured")


def rows_chosen(measured: list[Measurement]) -> frozenset[int]:
    """Every row count 1-`FUSED_ROWS[-1]` whose measured row count (itself, or the largest measured
    below it) ran faster fused."""
    faster = {m.rows for m in measured if m.fused_us < m.separate_us}
    return frozenset(n for n in range(1, FUSED_ROWS[-1] + 1) if max(r for r in FUSED_ROWS if r <= n) in faster)

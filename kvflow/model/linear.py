"""A projection prepared once at load (`Linear`): batch-invariant (`pack_invariant`, one kernel for
every row count), or the fastest path per row count up to `SMALL_ROWS[-1]`, measured on this machine
(`choose_small_paths`)."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from kvflow.model import cpu_kernels

log = logging.getLogger(__name__)

SMALL_PATHS = ("plain", "prepacked", "padded", "kernel", "fixed")
PADDED_ROWS = 4
FEW_ROWS = 16  # "padded" and "kernel" are for a few rows: candidates up to this many
# row counts measured at load; 5 uses 4's choice, and so on; above the last, "prepacked"
SMALL_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _triton_invariant():
    """The Triton projection's module, imported on first use (only CUDA uses it; Triton's import is slow)."""
    from kvflow.model import triton_invariant

    return triton_invariant


class Linear:
    """`y = x @ weight.T` with the weight ([out, in], Hugging Face layout) prepared once at load.

    `deterministic=True` (a batch-invariant model's projections): on CPU with the kernels built, every
    call, whatever its row count, is `cpu_kernels.invariant_linear` on the weight packed by
    `pack_invariant` (`invariant`), so a row's result never depends on the rows beside it; no other
    path is prepared. On CUDA with Triton it is `triton_invariant.linear` (fixed tiles, no split-K: also
    batch-invariant). Elsewhere it is `F.linear`, whose GEMM may block by row count (not batch-invariant).

    Otherwise, on CPU with oneDNN (fp32, bf16) the weight is also reordered into oneDNN's blocked layout and
    applied with its prepacked linear (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's
    freezing pass emits), faster than F.linear over a model's projections. Up to `SMALL_ROWS[-1]`
    rows (decoding up to that many sequences) the fastest path depends on the CPU and the row count,
    so the model measures it when it loads (`choose_small_paths`) and sets `small[rows]` to one of:
    "plain" (`F.linear` on the plain weight), "prepacked", "padded" (prepacked on the rows padded
    with zeros to 4: on some CPUs oneDNN runs 4 rows faster than 1-3), "kernel"
    (`cpu_kernels.skinny_linear`: each weight row read once for all rows; "padded" and "kernel" up
    to `FEW_ROWS`), or "fixed" (`cpu_kernels.invariant_linear` on the `pack_invariant` weight: AMX
    tiles or AVX512-BF16 dot products, prepared where the CPU has either; the model frees that copy
    if no row count chose it). The measurements are in docs/results.md. The price of prepacking is
    a second copy of the projection weights in memory (a third while "fixed" is chosen; one step
    reads one of them).
    """

    def __init__(self, weight: torch.Tensor, deterministic: bool = False) -> None:
        self.weight = weight.contiguous()
        cpu = weight.device.type == "cpu"
        self.deterministic = deterministic
        kernels = cpu and cpu_kernels.available("cpu")
        fixed = kernels and (deterministic or cpu_kernels.invariant_linear_isa(weight.dtype) != "fma")
        self.invariant = pack_invariant(self.weight) if fixed else None
        self.triton = deterministic and weight.device.type == "cuda" and _triton_invariant().available(weight.device)
        usable = cpu and not deterministic and _prepack_ok(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16) if usable else None
        self.small = {1: "plain", 2: "plain", 3: "prepacked"}

    @property
    def batch_invariant(self) -> bool:
        """Every call, whatever its row count, takes `invariant_linear` (deterministic, on CPU with the kernels)."""
        return self.deterministic and self.invariant is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return self.fixed(x)
        if self.triton:
            return _triton_invariant().linear(x, self.weight)
        return getattr(self, self.path(x.shape[0]))(x)

    def path(self, rows: int) -> str:
        """The path (one of `SMALL_PATHS`) a call with `rows` rows takes (not batch-invariant): "plain"
        without a prepacked weight, else the measured choice up to `SMALL_ROWS[-1]` rows and
        "prepacked" above."""
        return "plain" if self.packed is None else self.small.get(rows, "prepacked")

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def prepacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return self.prepacked(F.pad(x, (0, 0, 0, PADDED_ROWS - n)))[:n] if n < PADDED_ROWS else self.prepacked(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.skinny_linear(x.contiguous(), self.weight)

    def fixed(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.invariant_linear(x.contiguous(), self.invariant, self.weight.shape[0])


def pack_invariant(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in the layout `cpu_kernels.invariant_linear` reads on this CPU, zero-padded:
    for "amx-bf16" and "avx512-bf16" [out / 16, in / 2, 16, 2] (columns in panels of 16, pairs of
    the input dimension: one AMX B tile is 16 consecutive pair rows of a panel; out padded to 32, in
    to 32), for "fma" [out / V, in, V] (panels of the float32 vector width V, out padded to V)."""
    out, k = weight.shape
    if cpu_kernels.invariant_linear_isa(weight.dtype) == "fma":
        v = cpu_kernels.vec_size()
        w = F.pad(weight, (0, 0, 0, -out % v))
        return w.view(-1, v, k).transpose(1, 2).contiguous()
    w = F.pad(weight, (0, -k % 32, 0, -out % 32))
    return w.view(w.shape[0] // 16, 16, w.shape[1] // 2, 2).transpose(1, 2).contiguous()


_SMALL: dict[tuple[torch.dtype, int, tuple[str, ...]], dict[int, str]] = {}


def small_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths `choose_small_paths` may pick for weights of `dtype` on CPU: "kernel" only where the
    CPU kernels are built (and not turned off), "fixed" only where `Linear` prepares it too (the
    kernels built, and `invariant_linear` runs on AMX or AVX512-BF16 in this dtype).
    `KVFLOW_LINEAR_PATHS` (comma-separated `SMALL_PATHS`) leaves out the others, for comparisons."""
    kernel = cpu_kernels.available("cpu")
    fixed = kernel and cpu_kernels.invariant_linear_isa(dtype) != "fma"
    allowed = os.environ.get("KVFLOW_LINEAR_PATHS")
    allowed = set(allowed.split(",")) if allowed else set(SMALL_PATHS)
    if not allowed <= set(SMALL_PATHS) or not allowed & {"plain", "prepacked"}:
        raise ValueError(f"KVFLOW_LINEAR_PATHS must name some of {SMALL_PATHS}, plain or prepacked among them")
    return tuple(p for p in SMALL_PATHS if (p != "kernel" or kernel) and (p != "fixed" or fixed) and p in allowed)


def _small_key(dtype: torch.dtype, paths: tuple[str, ...]) -> tuple[torch.dtype, int, tuple[str, ...]]:
    """What a small-row choice holds for: the weights' dtype, the torch threads and the candidate paths."""
    return dtype, torch.get_num_threads(), paths


def choose_small_paths(linears: list[Linear]) -> dict[int, str]:
    """For every row count 1-`SMALL_ROWS[-1]`, the fastest of `small_paths` on this machine ("padded"
    and "kernel" only up to `FEW_ROWS`), timed at `SMALL_ROWS` over `linears` (up to 64 MB of them:
    a pass reads them from memory, as a decode step does; a row count between two measured ones takes
    the lower one's choice), the paths interleaved, the
    best of 4 passes after a warm-up (the minimum: another process on the machine can only make a
    pass slower, and with a median one interrupted pass could flip the choice).
    `KVFLOW_LINEAR_SMALL_ROWS` (one of `SMALL_PATHS`) sets all of them without measuring. Cached per
    dtype, torch thread count and kernel availability."""
    packed, nbytes = [], 0
    for lin in linears:  # enough matrices to overflow the caches (64 MB), not necessarily all
        if lin.packed is not None and nbytes < 64 << 20:
            packed.append(lin)
            nbytes += lin.weight.numel() * lin.weight.element_size()
    if not packed:
        return {}
    paths = small_paths(packed[0].weight.dtype)
    forced = os.environ.get("KVFLOW_LINEAR_SMALL_ROWS")
    if forced:
        if forced not in paths:
            raise ValueError(f"KVFLOW_LINEAR_SMALL_ROWS must be one of {paths} here, not {forced!r}")
        return dict.fromkeys(range(1, SMALL_ROWS[-1] + 1), forced)
    key = _small_key(packed[0].weight.dtype, paths)
    if key not in _SMALL:
        measured = {}
        with torch.inference_mode():
            for rows in SMALL_ROWS:
                xs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1]).to(lin.weight.dtype) for lin in packed}
                candidates = [p for p in paths if rows <= FEW_ROWS or p not in ("padded", "kernel")]
                t: dict[str, list[float]] = {p: [] for p in candidates}
                for rep in range(5):
                    for path in candidates:
                        t0 = time.perf_counter()
                        for lin in packed:
                            getattr(lin, path)(xs[lin.weight.shape[1]])
                        if rep:
                            t[path].append(time.perf_counter() - t0)
                measured[rows] = min(candidates, key=lambda p: min(t[p]))
        _SMALL[key] = {n: measured[max(r for r in SMALL_ROWS if r <= n)] for n in range(1, SMALL_ROWS[-1] + 1)}
    return _SMALL[key]


def adopt_small_paths(dtype: torch.dtype, choice: list[str]) -> bool:
    """Take `choice` (the path of rows 1, 2, ... `SMALL_ROWS[-1]` in order, as `chosen_small_paths`
    gives it) as this process's `choose_small_paths` for `dtype`, instead of measuring: a replacement
    stage takes what its predecessor measured (`WorkerSpec.small_paths`), which saves the
    measurement's seconds in a recovery and keeps the stage computing as it did. False (logged,
    nothing adopted: the model measures) for a choice this machine cannot run, e.g. a replacement
    on another kind of node, whose paths differ."""
    paths = small_paths(dtype)
    if len(choice) != SMALL_ROWS[-1] or any(p not in paths or (n > FEW_ROWS and p in ("padded", "kernel"))
                                            for n, p in enumerate(choice, 1)):
        log.warning("not adopting small-row paths %s: %d of %s are needed here (padded and kernel only up to %d "
                    "rows); measuring instead", choice, SMALL_ROWS[-1], paths, FEW_ROWS)
        return False
    _SMALL[_small_key(dtype, paths)] = dict(enumerate(choice, 1))
    return True


def chosen_small_paths(dtype: torch.dtype) -> list[str]:
    """What this process chose (measured or adopted) for `dtype`'s small row counts, rows 1, 2, ... in
    order; [] where it chose nothing (no CPU weights, a deterministic model, the paths forced)."""
    got = _SMALL.get(_small_key(dtype, small_paths(dtype)))
    return [got[n] for n in range(1, SMALL_ROWS[-1] + 1)] if got else []


_PREPACK_OK: dict[torch.dtype, bool] = {}


def _prepack_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs in `dtype` on this CPU, found by trying it once on a
    small matrix: oneDNN's bf16 path needs AVX512 (BW/VL/DQ) or AVX-NE-CONVERT, and refuses on
    AVX2-only CPUs, where the plain `F.linear` is used instead."""
    if dtype not in _PREPACK_OK:
        ok = dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available() \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        if ok:
            try:
                w = torch.ones(16, 16, dtype=dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
                torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=dtype), packed, None, "none", [], "")
            except RuntimeError:
                ok = False
        _PREPACK_OK[dtype] = ok
    return _PREPACK_OK[dtype]

"""kvflow's CPU kernels: one C++ extension, built once per machine, holding the model's fused passes.

The C++ lives in `csrc/` beside this module (`ops.h` declares every entry point, one file per kind of
kernel); this module builds it and holds the Python contracts:

- `paged_decode_attention(q, kv_layer, block_table, context_lens, scale)` attends one query token
  per sequence over the sequence's first `context_lens[b]` cached tokens, walking its block table
  block by block: every K and V byte is read once, straight from the cache, with no gathered copy.
  Work is split over (sequence, KV head) pairs; scores and output accumulate in float32. bf16 on a
  CPU with AVX512-BF16 (head dims 32, 64, 128, 256) runs bf16 dot products over staged 16-key groups.
- `paged_prefill_attention(...)`: causal attention of prompt chunks (whole prompts, or chunks after
  cached context) over the same paged cache, flash-attention style: 64-key tiles with the keys in
  vector lanes (bf16 dot products where the CPU has AVX512-BF16), an online softmax, no per-sequence
  K/V gather and no mask tensor; each row (query token x head) computed alone, so its result does
  not depend on the chunk it is in.
- `paged_prefill_attention_fast(...)`: the same contract on AMX tiles (bf16, head dims multiples of
  32; `fast_prefill_available`), NOT batch-invariant: flash attention with 32-key blocks packed from
  the cache into AMX's layouts, Q K^T and P V as tile products, the online softmax in float32 with
  AVX-512. The model's fast path takes it for long chunks where it measured faster (`prompt_attention`).
- `rms_norm(x, w, eps)` and `add_rms_norm(x, res, w, eps)` (x += res, then the norm of x, one pass).
- `silu_mul(gate_up)`: SiLU(gate) * up from the fused gate_up projection's output.
- `rope_write(qkv, cos, sin, heads, kv_heads, kv_layer, slots)`: RoPE in place on the query and key
  heads of the qkv projection's output, then the new K and V rows copied into the paged cache.
- `skinny_linear(x, w)`: a projection of a few rows that reads each weight row once (a decode step of
  a few sequences is bound by reading the weights, which oneDNN's prepacked GEMM did well short of
  the memory bandwidth), in float32, bf16 or fp16, accumulated in float32.
- `invariant_linear(x, packed, out)`: a projection of any number of rows whose every output element
  is one fixed chain of multiply-adds over the input dimension, so a row's result does not depend on
  the other rows (AMX tiles, AVX512-BF16 dot products or float32 FMAs, one of them per machine and
  dtype: `invariant_linear_isa`); the weight is packed for it by `kvflow.model.linear`.
- `paged_decode_attention(..., invariant=True)`: decode rows through the prefill kernel, as
  one-token chunks, so a token's attention is the same decoded, prefilled or recomputed.
- `decode_layers(...)`: a decode-only step's whole layer loop, calling the kernels above and the
  model's chosen projection path from C++ (bitwise the model's per-op path, without ~25 Python
  calls per layer).

Every elementwise pass is vectorised in every dtype: bf16/fp16 values are widened to float32, and
rounded back to the dtype at the points where the PyTorch formula they replace stores a tensor.

Why kernels: the eager decode attention spent most of its time gathering KV into a copy, and a
decode step ran ~20 small ATen ops per layer, each its own OpenMP parallel region (measurements:
docs/results.md). The elementwise kernels split rows over threads only above `GRAIN` elements, so a small decode
batch runs on the calling thread. The extension is built with the C++ compiler torch.compile would
need anyway (`torch.utils.cpp_extension`), once per machine: cached under `$KVFLOW_CACHE_DIR/kernels`,
keyed by the sources' contents, the compiler, torch and the CPU (`build_directory`), and shared by
every checkout and environment; where it cannot be built, on a non-CPU device, or with `KVFLOW_CPU_KERNELS=0`,
`available()` is False and the model keeps its pure-PyTorch path, so results never depend on having
a compiler.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")  # the extension's C++ sources (ops.h lists its entry points)

_lock = threading.Lock()
_op = None
_failed = False


# -ffp-contract=off: no multiply and add fused unless the source says so (GCC's default for C++ fuses
# where it sees fit, so two kernels written with the same arithmetic could round differently; the
# batch-invariant paths rely on writing the same arithmetic twice)
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)


def build_directory(sources: dict[str, bytes] | None = None) -> Path:
    """Where the built kernel lives: `$KVFLOW_CACHE_DIR/kernels/` (default `~/.cache/kvflow`), named by a
    hash of everything the binary depends on and nothing else: the sources (`_read_sources()`: a
    changed, added or removed file is a new build), the compiler and its flags, the torch version
    (its headers and ABI), the Python ABI and the CPU (-march=native ties the build to the CPU's
    features). Not the checkout or the interpreter's path: a second checkout or virtual environment
    with the same sources and torch loads the same build instead of compiling its own."""
    from kvflow.model.loader import cache_root

    key = hashlib.sha256()
    for name, text in sorted((sources or _read_sources()).items()):
        key.update(f"csrc/{name}".encode() + b"\0" + text + b"\0")
    for part in (*_CFLAGS, *_capability_defines(), "|", *_LDFLAGS, "|", _compiler_version(), torch.__version__,
                 sys.implementation.cache_tag, str(torch.backends.cpu.get_cpu_capability()), _cpu_flags()):
        key.update(part.encode() + b"\0")
    return cache_root() / "kernels" / f"kvflow_cpu_kernels_{key.hexdigest()[:16]}"


def _compiler_version() -> str:
    """The first line of `c++ --version` of the compiler torch builds with ($CXX, else c++)."""
    import subprocess

    from torch.utils.cpp_extension import get_cxx_compiler

    try:
        out = subprocess.run([get_cxx_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "no compiler"
    return out.splitlines()[0] if out else "unknown compiler"


def _read_sources() -> dict[str, bytes]:
    """The extension's sources and headers in `csrc/`, by file name."""
    return {p.name: p.read_bytes() for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h")}


def _build():
    """The kernel module: loaded from the cache when built before (by any checkout or environment),
    else compiled once. Builders take an OS file lock per build (released when its holder dies, so a
    builder killed mid-way blocks no one), compile in a directory of their own and rename it into
    place when done: a reader never sees a half-written build, and whoever waited on the lock loads
    the finished one."""
    import fcntl
    import importlib.util
    import shutil
    import time

    sources = _read_sources()
    final = build_directory(sources)
    name = final.name
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(name + ".lock"), "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("[kvflow] waiting for another process building the CPU kernels", file=sys.stderr, flush=True)
            fcntl.flock(guard, fcntl.LOCK_EX)
        for stale in final.parent.glob(name + ".tmp-*"):  # left by a builder that died: we hold its lock now
            shutil.rmtree(stale, ignore_errors=True)
        built = final / f"{name}.so"
        if built.is_file():
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        tmp = final.with_name(f"{name}.tmp-{os.getpid()}")
        src = tmp / "csrc"
        src.mkdir(parents=True)
        for file, text in sources.items():
            (src / file).write_bytes(text)
        t0 = time.perf_counter()
        try:
            with _ticking(f"[kvflow] compiling the CPU kernels (once per machine, torch and kernel sources; "
                          f"about a minute) into {final}"):
                module = _compile(name, src, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tmp.rename(final)
        print(f"[kvflow] CPU kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return module


def _compile(name: str, src: Path, build_dir: Path):
    from torch.utils.cpp_extension import load

    cpp = [str(src / f) for f in sorted(os.listdir(src)) if f.endswith(".cpp")]
    return load(name=name, sources=cpp, extra_cflags=[*_CFLAGS, *_capability_defines()], extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir), verbose=False)


class _ticking:
    """Prints `what` to stderr, then (on a terminal) the seconds elapsed, once a second, until the block ends."""

    def __init__(self, what: str) -> None:
        self.what, self.done = what, threading.Event()

    def __enter__(self) -> None:
        from tqdm import tqdm

        print(self.what, file=sys.stderr, flush=True)
        self.bar = tqdm(desc="[kvflow] compiling", bar_format="{desc}: {elapsed}", file=sys.stderr, disable=None,
                        leave=False)
        self.thread = threading.Thread(target=self._tick, daemon=True, name="kvflow-build-ticker")
        self.thread.start()

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            self.bar.refresh()

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.bar.close()


def _capability_defines() -> list[str]:
    """ATen's vector types use SIMD only under its CPU_CAPABILITY macros (as torch.compile's C++ does)."""
    cap = str(torch.backends.cpu.get_cpu_capability())
    if cap.startswith("AVX512"):
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


GRAIN = 32768  # elements; `kGrain` of csrc/elementwise.cpp (a call splits rows over threads only above it)
DECODE_PATHS = ("kernel", "prepacked", "padded", "plain", "fixed")  # `decode_layers`' projection paths, by number


def enabled() -> bool:
    """`KVFLOW_CPU_KERNELS=0` turns every kernel off (the pure-PyTorch path, for comparisons)."""
    return os.environ.get("KVFLOW_CPU_KERNELS", "1") != "0"


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernels can run on `device` (builds the extension on first call, or loads the cached
    build; False on non-CPU devices, with `KVFLOW_CPU_KERNELS=0`, or if it cannot be built)."""
    global _op, _failed
    if torch.device(device).type != "cpu" or not enabled():
        return False
    with _lock:
        if _op is None and not _failed:
            try:
                _op = _build()
            except Exception as e:  # no compiler, no headers: the PyTorch path still works
                _failed = True
                log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
    return _op is not None


def vec_size() -> int:
    """float32 lanes of the kernels' vectors (16 with AVX-512, 8 with AVX2). Call `available()` first."""
    return _op.vec_size()


def paged_attention_supported(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `paged_decode_attention` and `paged_prefill_attention` handle this attention: heads of
    `head_dim` a multiple of the vector width (1-16 vectors), and (prefill) at most 32-64 query heads per
    KV head (four vectors of rows, by the CPU's vector width). Call `available()` first."""
    assert _op is not None, "paged_attention_supported called before available()"
    chunks = head_dim // _op.vec_size()
    return (head_dim % _op.vec_size() == 0 and chunks in (1, 2, 4, 8, 16)
            and num_heads // num_kv_heads <= _op.prefill_max_group())


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), kv_layer [2, num_blocks, block_size, kv_heads, D] (one layer
    of `KVCache`), block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D].
    Query head j attends with KV head j // (H // kv_heads). `invariant`: computed by the prefill kernel
    as one-token chunks, bitwise what `paged_prefill_attention` gives the same token in any chunk.
    Call `available()` first."""
    assert _op is not None, "paged_decode_attention called before available()"
    if invariant:
        return _op.paged_decode_invariant(q.contiguous(), kv_layer, block_table, context_lens, scale)
    return _op.paged_decode(q.contiguous(), kv_layer, block_table, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of prompt chunks over the paged cache. q [T, H, D] (each row's heads contiguous;
    rows may be strided, as in a view of the qkv projection), kv_layer [2, num_blocks, block_size,
    kv_heads, D] holding every sequence's K/V including the chunk's own; per sequence s (int64 [S]):
    its chunk is rows query_start[s] .. + query_len[s] of q, the last tokens of its context_lens[s]
    cached tokens, in blocks block_table[s] ([S, max_blocks]). -> [T, H, D]; rows that belong to no
    sequence are left unset. Same head_dims as `paged_attention_supported`. Call `available()` first."""
    assert _op is not None, "paged_prefill_attention called before available()"
    return _op.paged_prefill(q, kv_layer, block_table, query_start, query_len, context_lens, scale)


def fast_prefill_available(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `paged_prefill_attention_fast` runs this attention here: the kernels built with AMX, the
    OS letting this process use the tiles, bf16, head_dim a multiple of 32 up to 256 and at most 16
    query heads per KV head (False elsewhere, e.g. a CPU with AVX512-BF16 but no AMX)."""
    return (available() and dtype == torch.bfloat16 and head_dim % 32 == 0 and 0 < head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16 and _op.prefill_amx_usable())


def paged_prefill_attention_fast(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    query_len: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention`'s contract on AMX tiles (bf16 only; see `fast_prefill_available`), not
    batch-invariant: a row's result depends on where it sits in its chunk. Writes into `out` ([T, H, D]
    contiguous bf16) when given, leaving its rows of no sequence as they were; returns it."""
    assert _op is not None, "paged_prefill_attention_fast called before available()"
    return _op.paged_prefill_amx(q, kv_layer, block_table, query_start, query_len, context_lens, scale, out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [T, D] (contiguous) -> a new [T, D]: in float32, then (other
    dtypes) rounded to x's dtype before the weight multiplies, as transformers does."""
    return _op.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += residual` in place (x [T, D] contiguous, same dtype), then `rms_norm(x)` in the same pass."""
    return _op.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, contiguous) -> SiLU(gate) * up [T, I]."""
    return _op.silu_mul(gate_up)


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_layer: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> None:
    """RoPE (rotate_half style) in place on the query and key heads of qkv [T, (H + 2 KVH) * D]
    (contiguous), with cos/sin [T, D] in qkv's dtype; then, if `kv_layer` ([2, blocks, block_size, KVH, D],
    qkv's dtype) is given, token t's rotated K and its V are copied to flat slot `slots[t]` (int64)."""
    _op.rope_write(qkv, cos, sin, num_heads, num_kv_heads, kv_layer, slots)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ weight [out, in]^T -> [N, out] (float32, bf16 or fp16, one dtype, both contiguous),
    accumulated in float32; for a few rows (decoding a few sequences), where the projection is bound by
    reading the weight: each weight row is read from memory once for all N rows of x. Call
    `available()` first."""
    return _op.skinny_linear(x, weight)


def invariant_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, in] (contiguous) @ W^T -> [M, out_features] in x's dtype, W packed by
    `kvflow.model.linear.pack_invariant` for `invariant_linear_isa(dtype)`. Every output element is one
    chain of multiply-adds over `in` in a fixed order (float32 accumulators, one rounding at the end),
    whatever M is: row i's result is bitwise the same alone or among any other rows. Call
    `available()` first."""
    return _op.invariant_linear(x, packed, out_features)


def invariant_linear_isa(dtype: torch.dtype) -> str:
    """How `invariant_linear` computes in `dtype` on this CPU: "amx-bf16" (bf16 with AMX),
    "avx512-bf16" (bf16 with AVX512-BF16, no AMX) or "fma" (float32 FMAs: float32, fp16, and bf16 on
    CPUs without native bf16). One per machine and dtype, for every row count. Call `available()` first."""
    return _op.invariant_linear_isa(str(dtype).removeprefix("torch."))


def decode_layers(
    hidden: torch.Tensor,
    input_norms: list[torch.Tensor],
    post_norms: list[torch.Tensor],
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    path: int,
    kv_layers: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    eps: float,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's layers in one call (see `LlamaModel.run_layers`): hidden [T, D], one query token
    per sequence -> (residual stream, last MLP output). Per layer its norms, KV view and the four
    projections (qkv, o, gate_up, down; plain and prepared weights, `path` the index in
    `DECODE_PATHS` of the `Linear` path to take; for "fixed", `packed` holds the `invariant_linear`
    weights). `invariant`: `packed` holds the `invariant_linear`
    weights, which every projection takes (`path` unused), and attention is
    `paged_decode_attention(..., invariant=True)`. Call `available()` first."""
    x, delta = _op.decode_layers(hidden, input_norms, post_norms, weights, packed, path, kv_layers, cos, sin, slots,
                                 block_table, context_lens, eps, scale, num_heads, num_kv_heads, invariant)
    return x, delta

"""Decode attention that reads K and V where they live in the paged cache (a small CPU kernel).

`paged_decode_attention(q, kv_layer, block_table, context_lens, scale)` attends one query token
per sequence over the sequence's first `context_lens[b]` cached tokens, walking its block table
block by block: every K and V byte is read once, straight from the cache, with no gathered copy
of the sequence's KV. Work is split over (sequence, KV head) pairs on PyTorch's intra-op thread
pool; scores and the output accumulate in float32 whatever the cache dtype (float32, bfloat16,
float16).

Why a kernel: at batch 16 and 1k tokens of context the eager path (index_select of every block,
a transposing copy for the batched matmul, two bmm) spent ~85% of its time copying KV, and the
torch.compile'd fused-gather variant spent it in horizontal reductions (see docs/model.md for
the side-by-side numbers). The kernel is built once per machine with the C++ compiler that
torch.compile would need anyway (`torch.utils.cpp_extension`, cached under
`$TORCH_EXTENSIONS_DIR`); where it cannot be built, or on a non-CPU device, `available()` is
False and the model keeps its gather path, so results never depend on having a compiler.
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

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

template <typename T> inline Vec load_f32(const T* p) { Vec o; at::vec::load_to_float<T>(p, o); return o; }
template <> inline Vec load_f32<float>(const float* p) { return Vec::loadu(p); }

// Work items are heads [h0, h1) of one sequence: all KV heads of a sequence when there are at
// least as many sequences as threads (each token's K and V rows are then read contiguously, once),
// else one KV head each (batch 1 still uses every thread). Pass 1 reads K block by block into
// (head, group) x n float scores, a vectorised softmax per row, pass 2 reads V block by block into
// float accumulators (head, group) x D. q is pre-scaled into float once per item.
template <typename T, int C>
static void decode_kernel(const T* q, const T* kv, const int64_t* table, const int64_t* ctx, T* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks, int64_t v_offset, float scale) {
  constexpr int64_t D = C * Vec::size();
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t per_item = B >= at::get_num_threads() ? KVH : 1;  // KV heads per work item
  at::parallel_for(0, B * (KVH / per_item), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv;
    std::vector<Vec> qv, acc;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (KVH / per_item), h0 = (w % (KVH / per_item)) * per_item, n = ctx[b];
      const int64_t rows = per_item * G;  // query heads h0 * G .. h0 * G + rows
      const int64_t* blocks = table + b * max_blocks;
      const T* qb = q + (b * H + h0 * G) * D;
      qv.resize(rows * C);
      for (int64_t i = 0; i < rows * C; ++i) qv[i] = load_f32<T>(qb + i * Vec::size()) * Vec(scale);
      scores.resize(rows * n);
      inv.resize(rows);
      for (int64_t t0 = 0; t0 < n; t0 += BS) {
        const T* kb = kv + blocks[t0 / BS] * blk_stride + h0 * D;
        const int64_t len = std::min(n - t0, BS);
        for (int64_t t = 0; t < len; ++t) {
          for (int64_t hh = 0; hh < per_item; ++hh) {
            const T* k = kb + t * tok_stride + hh * D;
            Vec kc[C];
            for (int c = 0; c < C; ++c) kc[c] = load_f32<T>(k + c * Vec::size());
            for (int64_t g = 0; g < G; ++g) {
              const Vec* qg = qv.data() + (hh * G + g) * C;
              Vec dot = qg[0] * kc[0];
              for (int c = 1; c < C; ++c) dot = at::vec::fmadd(qg[c], kc[c], dot);
              scores[(hh * G + g) * n + t0 + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dot);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * n;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, s, s, n);
        inv[r] = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
      }
      acc.assign(rows * C, Vec(0.f));
      for (int64_t t0 = 0; t0 < n; t0 += BS) {
        const T* vb = kv + v_offset + blocks[t0 / BS] * blk_stride + h0 * D;
        const int64_t len = std::min(n - t0, BS);
        for (int64_t t = 0; t < len; ++t) {
          for (int64_t hh = 0; hh < per_item; ++hh) {
            const T* v = vb + t * tok_stride + hh * D;
            Vec vc[C];
            for (int c = 0; c < C; ++c) vc[c] = load_f32<T>(v + c * Vec::size());
            for (int64_t g = 0; g < G; ++g) {
              const Vec pt(scores[(hh * G + g) * n + t0 + t]);
              Vec* a = acc.data() + (hh * G + g) * C;
              for (int c = 0; c < C; ++c) a[c] = at::vec::fmadd(pt, vc[c], a[c]);
            }
          }
        }
      }
      T* ob = out + (b * H + h0 * G) * D;
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < C; ++c) {
          float tmp[Vec::size()];
          (acc[r * C + c] * Vec(inv[r])).store(tmp);
          for (int64_t i = 0; i < Vec::size(); ++i) ob[r * D + c * Vec::size() + i] = static_cast<T>(tmp[i]);
        }
    }
  });
}

int64_t vec_size() { return Vec::size(); }

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor table, torch::Tensor ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [B, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && table.is_contiguous() && ctx.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "int64 block table and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == B && ctx.size(0) == B, "shape mismatch");
  auto out = torch::empty_like(q);
  auto run = [&](auto tag, auto chunks) {
    using T = decltype(tag);
    decode_kernel<T, decltype(chunks)::value>(q.data_ptr<T>(), kv.data_ptr<T>(), table.data_ptr<int64_t>(),
        ctx.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, KVH, BS, table.size(1), kv.stride(0), static_cast<float>(scale));
  };
  auto by_dim = [&](auto tag) {
    switch (D / Vec::size()) {
      case 1: run(tag, std::integral_constant<int, 1>{}); break;
      case 2: run(tag, std::integral_constant<int, 2>{}); break;
      case 4: run(tag, std::integral_constant<int, 4>{}); break;
      case 8: run(tag, std::integral_constant<int, 8>{}); break;
      case 16: run(tag, std::integral_constant<int, 16>{}); break;
      default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", D);
    }
  };
  TORCH_CHECK(D % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  switch (q.scalar_type()) {
    case at::kFloat: by_dim(float{}); break;
    case at::kBFloat16: by_dim(at::BFloat16{}); break;
    case at::kHalf: by_dim(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}
"""

_lock = threading.Lock()
_op = None
_failed = False


def build_directory() -> Path:
    """Where the kernel is built and cached (`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions).
    -march=native: the build is tied to this CPU, so the CPU's capability is part of its name; so is
    the interpreter's environment (its torch headers are in the build file: two venvs sharing one
    build directory would rebuild it in turn)."""
    key = hashlib.sha256((_SOURCE + torch.__version__ + str(torch.backends.cpu.get_cpu_capability()) + _cpu_flags()
                          + sys.prefix).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return root / f"kvflow_paged_attention_{key.hexdigest()[:12]}"


def _build():
    import fcntl

    from torch.utils.cpp_extension import load_inline

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch serialises builds with a lock file that a process killed while building leaves behind,
    # and every later build then waits for it forever. An OS lock is released when its holder dies:
    # whoever holds it is the only builder, so a lock file found then is stale.
    with open(build_dir / "kvflow.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load_inline(
            name=build_dir.name,
            cpp_sources=_SOURCE,
            functions=["paged_decode", "vec_size"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *_capability_defines()],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


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


def available(device: torch.device | str = "cpu", head_dim: int = 64) -> bool:
    """Whether the kernel can run on `device` for heads of `head_dim` (builds it on first call, or loads
    the cached build; False if it cannot be built). KVFLOW_PAGED_KERNEL=0 turns it off (for comparisons)."""
    global _op, _failed
    if torch.device(device).type != "cpu" or os.environ.get("KVFLOW_PAGED_KERNEL", "1") == "0":
        return False
    with _lock:
        if _op is None and not _failed:
            try:
                _op = _build()
            except Exception as e:  # no compiler, no headers: the gather path still works
                _failed = True
                log.warning("paged attention kernel unavailable (%s); using the gather path", e)
    if _op is None:
        return False
    chunks = head_dim // _op.vec_size()
    return head_dim % _op.vec_size() == 0 and chunks in (1, 2, 4, 8, 16)


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), kv_layer [2, num_blocks, block_size, kv_heads, D] (one layer
    of `KVCache`), block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D].
    Query head j attends with KV head j // (H // kv_heads). Call `available()` first."""
    assert _op is not None, "paged_decode_attention called before available()"
    return _op.paged_decode(q.contiguous(), kv_layer, block_table, context_lens, scale)

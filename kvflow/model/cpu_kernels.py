"""kvflow's CPU kernels: one small C++ extension, built once per machine.

- `paged_decode_attention(q, kv_layer, block_table, context_lens, scale)` attends one query token
  per sequence over the sequence's first `context_lens[b]` cached tokens, walking its block table
  block by block: every K and V byte is read once, straight from the cache, with no gathered copy
  of the sequence's KV. Work is split over (sequence, KV head) pairs on PyTorch's intra-op thread
  pool; scores and the output accumulate in float32 whatever the cache dtype (float32, bfloat16,
  float16). Why: at batch 16 and 1k tokens of context the eager path (index_select of every
  block, a transposing copy for the batched matmul, two bmm) spent ~85% of its time copying KV,
  and the torch.compile'd fused-gather variant spent it in horizontal reductions (docs/model.md).
- `rms_norm(x, weight, eps, residual=None)` (transformers' LlamaRMSNorm, with the residual add
  before it fused in) and `silu_mul(gate_up)` (SiLU(gate) * up of the fused projection): one pass
  each instead of three to six ATen ops, on the calling thread for the small tensors of decode
  steps. Why: a decode step of SmolLM2 ran ~20 small ops per layer, each an OpenMP region (a
  [16, 576] `F.rms_norm` cost ~115 us), a tenth of the step beside the projections (docs/model.md).

Built with the C++ compiler that torch.compile would need anyway (`torch.utils.cpp_extension`,
cached under `$TORCH_EXTENSIONS_DIR`); where it cannot be built, or on a non-CPU device,
`available()` is False and the model keeps its PyTorch paths, so results never depend on having a
compiler. `KVFLOW_PAGED_KERNEL=0` / `KVFLOW_FUSED_KERNELS=0` turn either family off (comparisons).
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
#include <cmath>
#include <limits>
#include <type_traits>
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


// ------------------------------------------------------------------ fused elementwise ops
// Each replaces several ATen ops (each its own pass over the tensor and, from a few thousand
// elements on, its own OpenMP region with a barrier). Rows run on the calling thread until there
// are enough of them to be worth a parallel region (`grain` elements). Arithmetic in float32;
// a bfloat16/half tensor is rounded where transformers' module rounds it, so results match its
// order of operations (float32: identical formulas).

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }
constexpr int64_t kGrain = 16384;  // elements below which a fused op stays on the calling thread

// out = rmsnorm(x) * w (transformers' LlamaRMSNorm); with `r`: x_out = x + r first, normalised.
template <typename T>
static void rms_rows(const T* x, const T* r, const T* w, T* x_out, T* out, int64_t rows, int64_t H, float eps) {
  const int64_t V = Vec::size(), grain = std::max<int64_t>(1, kGrain / H);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * H;
      if (r != nullptr) {  // the residual add, rounded to T as transformers' `residual + hidden` is
        const T* rr = r + t * H;
        T* xo = x_out + t * H;
        for (int64_t i = 0; i < H; ++i) { xo[i] = static_cast<T>(to_f(xr[i]) + to_f(rr[i])); buf[i] = to_f(xo[i]); }
      } else {
        for (int64_t i = 0; i < H; ++i) buf[i] = to_f(xr[i]);
      }
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + V <= H; i += V) { Vec v = Vec::loadu(buf.data() + i); acc = at::vec::fmadd(v, v, acc); }
      float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      for (; i < H; ++i) ss += buf[i] * buf[i];
      const float rs = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + t * H;
      for (int64_t k = 0; k < H; ++k) {
        if constexpr (std::is_same_v<T, float>) o[k] = w[k] * (buf[k] * rs);
        else o[k] = static_cast<T>(to_f(w[k]) * to_f(static_cast<T>(buf[k] * rs)));
      }
    }
  });
}

template <typename F> static void by_dtype(at::ScalarType st, const char* name, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", st);
  }
}

std::vector<torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: x [T, H] contiguous, w [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight dtype differs from x");
  auto out = torch::empty_like(x);
  torch::Tensor x_out = x;
  const bool add = residual.has_value();
  if (add) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
    x_out = torch::empty_like(x);
  }
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(x.data_ptr<T>(), add ? residual->data_ptr<T>() : nullptr, w.data_ptr<T>(), x_out.data_ptr<T>(),
                out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {x_out, out};
}

// gu [T, 2I] (gate | up, the fused projection's output) -> silu(gate) * up [T, I]
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: gu [T, 2I] contiguous");
  const int64_t rows = gu.size(0), I = gu.size(1) / 2, V = Vec::size();
  auto out = torch::empty({rows, I}, gu.options());
  by_dtype(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gu.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / I), [&](int64_t begin, int64_t end) {
      std::vector<float> s(I);
      for (int64_t t = begin; t < end; ++t) {
        const T* g = src + t * 2 * I;
        const T* u = g + I;
        int64_t i = 0;
        for (; i + V <= I; i += V) {
          Vec gv = load_f32<T>(g + i);
          (gv / (Vec(1.f) + gv.neg().exp())).store(s.data() + i);
        }
        for (; i < I; ++i) s[i] = to_f(g[i]) / (1.f + std::exp(-to_f(g[i])));
        T* o = dst + t * I;
        for (int64_t k = 0; k < I; ++k) {
          if constexpr (std::is_same_v<T, float>) o[k] = s[k] * u[k];
          else o[k] = static_cast<T>(to_f(static_cast<T>(s[k])) * to_f(u[k]));  // silu rounded, as F.silu's output
        }
      }
    });
  });
  return out;
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
    return root / f"kvflow_cpu_kernels_{key.hexdigest()[:12]}"


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
            functions=["paged_decode", "vec_size", "rms_norm", "silu_mul"],
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


def _load() -> bool:
    """Build the extension on first call (or load the cached build); False if it cannot be built."""
    global _op, _failed
    with _lock:
        if _op is None and not _failed:
            try:
                _op = _build()
            except Exception as e:  # no compiler, no headers: the PyTorch paths still work
                _failed = True
                log.warning("kvflow CPU kernels unavailable (%s); using the PyTorch paths", e)
    return _op is not None


def available(device: torch.device | str = "cpu", head_dim: int = 64) -> bool:
    """Whether the paged decode kernel can run on `device` for heads of `head_dim` (builds the
    extension on first call). KVFLOW_PAGED_KERNEL=0 turns it off (for comparisons)."""
    if torch.device(device).type != "cpu" or os.environ.get("KVFLOW_PAGED_KERNEL", "1") == "0" or not _load():
        return False
    chunks = head_dim // _op.vec_size()
    return head_dim % _op.vec_size() == 0 and chunks in (1, 2, 4, 8, 16)


def fused_available(device: torch.device | str = "cpu") -> bool:
    """Whether the fused RMSNorm and SiLU-and-multiply kernels can run on `device` (CPU tensors of
    float32, bfloat16 or float16). KVFLOW_FUSED_KERNELS=0 turns them off (for comparisons)."""
    if torch.device(device).type != "cpu" or os.environ.get("KVFLOW_FUSED_KERNELS", "1") == "0":
        return False
    return _load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (x', rmsnorm(x') * weight) where x' = x + residual (rounded to x's dtype, as
    transformers adds the residual) or x itself; new tensors, the inputs are not written.
    Call `fused_available()` first."""
    assert _op is not None, "rms_norm called before fused_available()"
    x_out, out = _op.rms_norm(x.contiguous(), None if residual is None else residual.contiguous(), weight, eps)
    return x_out, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> SiLU(gate) * up [T, I]. Call `fused_available()` first."""
    assert _op is not None, "silu_mul called before fused_available()"
    return _op.silu_mul(gate_up.contiguous())


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), kv_layer [2, num_blocks, block_size, kv_heads, D] (one layer
    of `KVCache`), block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D].
    Query head j attends with KV head j // (H // kv_heads). Call `available()` first."""
    assert _op is not None, "paged_decode_attention called before available()"
    return _op.paged_decode(q.contiguous(), kv_layer, block_table, context_lens, scale)

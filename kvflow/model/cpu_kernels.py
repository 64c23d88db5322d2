"""kvflow's CPU kernels: one C++ extension, built once per machine, holding the model's fused passes.

- `paged_decode_attention(q, kv_layer, block_table, context_lens, scale)` attends one query token
  per sequence over the sequence's first `context_lens[b]` cached tokens, walking its block table
  block by block: every K and V byte is read once, straight from the cache, with no gathered copy.
  Work is split over (sequence, KV head) pairs; scores and output accumulate in float32. bf16 on a
  CPU with AVX512-BF16 (head dims 32, 64, 128, 256) runs bf16 dot products over staged 16-key groups: 1.4-1.6x
  the widening loop from memory, about the rate a loop that only reads the same blocks reaches.
- `paged_prefill_attention(...)`: causal attention of prompt chunks (whole prompts, or chunks after
  cached context) over the same paged cache, flash-attention style: register-blocked float32 tiles,
  an online softmax, no per-sequence K/V gather and no mask tensor. About 2x `scaled_dot_product_
  attention` on a 256-token prompt, 3x in bf16 where the CPU has AVX512-BF16's dot product (docs/model.md).
- `rms_norm(x, w, eps)` and `add_rms_norm(x, res, w, eps)` (x += res, then the norm of x, one pass).
- `silu_mul(gate_up)`: SiLU(gate) * up from the fused gate_up projection's output.
- `rope_write(qkv, cos, sin, heads, kv_heads, kv_layer, slots)`: RoPE in place on the query and key
  heads of the qkv projection's output, then the new K and V rows copied into the paged cache.
- `skinny_linear(x, w)`: a projection of a few rows that reads each weight row once (a decode step of
  a few sequences is bound by reading the weights; oneDNN's prepacked GEMM reached ~75% of the memory
  bandwidth there), in float32, bf16 or fp16, accumulated in float32.
- `decode_layers(...)`: a decode-only step's whole layer loop, calling the kernels above and the
  model's chosen projection path from C++ (bitwise the model's per-op path, without ~25 Python
  calls per layer).

Every elementwise pass is vectorised in every dtype: bf16/fp16 values are widened to float32, and
rounded back to the dtype at the points where the PyTorch formula they replace stores a tensor.

Why kernels: at batch 16 and 1k tokens of context the eager decode attention spent ~85% of its time
copying KV; and a decode step ran ~20 small ATen ops per layer, each its own OpenMP parallel region,
which cost as much as vLLM's whole gap at batch 1 (see docs/model.md). The elementwise kernels
split rows over threads only above `GRAIN` elements, so a small decode batch runs on the calling
thread. The extension is built with the C++ compiler torch.compile would need anyway
(`torch.utils.cpp_extension`, cached under `$TORCH_EXTENSIONS_DIR`); where it cannot be built, on a
non-CPU device, or with `KVFLOW_CPU_KERNELS=0`, `available()` is False and the model keeps its
pure-PyTorch path, so results never depend on having a compiler.
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
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

using Vec = at::vec::Vectorized<float>;

// The long entry points (decode_layers, a whole decode step of 10-25 ms; the two attention kernels)
// release the GIL while they compute, as PyTorch's own ops do: holding it froze the serving event
// loop for the whole step (a 1 ms timer woke 13-25 ms late; new requests and streamed tokens waited
// for the step's end). The short elementwise ones keep it: each release is a chance for a busy
// event loop to take the GIL for up to a switch interval. Calls from inside another kernel
// (decode_layers -> paged_decode) hold no GIL and release nothing.
struct NoGil {
  PyThreadState* state = PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  NoGil() = default;
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() { if (state) PyEval_RestoreThread(state); }
};

template <typename T> inline Vec load_f32(const T* p) { Vec o; at::vec::load_to_float<T>(p, o); return o; }
template <> inline Vec load_f32<float>(const float* p) { return Vec::loadu(p); }
// v rounded to T (round to nearest even, as a tensor stored in T holds it), back in float.
template <typename T> inline Vec round_t(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) { return v; }
  else { return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v))); }
}
// Stores the Vec::size() floats of v at p, rounded to T.
template <typename T> inline void store_t(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) { v.store(p); }
  else { at::vec::convert_from_float<T>(v, v).store(p, Vec::size()); }
}
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// With AVX512-BF16, float -> bf16 is one instruction (round to nearest even, as ATen's conversion;
// ATen's portable one takes ~8, with its NaN check, and dominated the bf16 elementwise passes).
template <> inline Vec round_t<at::BFloat16>(const Vec& v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
template <> inline void store_t<at::BFloat16>(at::BFloat16* p, const Vec& v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

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


// ---------------------------------------------------------------- elementwise passes of a layer
// Rows are split over threads only when a call has at least kGrain elements: below that a parallel
// region (fork, barrier) costs more than the pass itself, so small decode batches stay on the
// calling thread (at::parallel_for runs inline when end - begin < grain).
constexpr int64_t kGrain = 32768;

static int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, width)); }

template <typename T> inline T to_t(float x) { return static_cast<T>(x); }

// out[r] = w * T(x[r] * rsqrt(mean(x[r]^2) + eps)) (transformers' LlamaRMSNorm order); with `res`,
// x[r] += res[r] first (rounded to T, stored back in x) and the norm reads the sum.
template <typename T>
static void rms_norm_kernel(T* x, const T* res, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      float* b = buf.data();
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + V <= n; i += V) {
        Vec v = load_f32<T>(xr + i);
        if (res) {  // the residual stream is stored in T: the norm reads the rounded sum
          v = round_t<T>(v + load_f32<T>(res + r * n + i));
          store_t<T>(xr + i, v);
        }
        v.store(b + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
      for (; i < n; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res) { xr[i] = to_t<T>(v + static_cast<float>(res[r * n + i])); v = static_cast<float>(xr[i]); }
        b[i] = v;
        ss += v * v;
      }
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
      i = 0;  // bf16/fp16: the normalised row is rounded to T before the weight multiplies
      for (; i + V <= n; i += V) store_t<T>(o + i, round_t<T>(Vec::loadu(b + i) * Vec(rstd)) * load_f32<T>(w + i));
      for (; i < n; ++i) o[i] = to_t<T>(static_cast<float>(w[i]) * static_cast<float>(to_t<T>(b[i] * rstd)));
    }
  });
}

// out[r] = silu(gu[r, :n]) * gu[r, n:] (the fused gate_up projection's output, [rows, 2n] -> [rows, n]).
template <typename T>
static void silu_mul_kernel(const T* gu, T* out, int64_t rows, int64_t n) {
  constexpr int64_t V = Vec::size();
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;  // bf16/fp16: silu rounded to T, then the product (as F.silu(gate) * up)
      for (; i + V <= n; i += V) {
        const Vec x = load_f32<T>(g + i);
        store_t<T>(o + i, round_t<T>(x / (Vec(1.f) + x.neg().exp())) * load_f32<T>(u + i));
      }
      for (; i < n; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = to_t<T>(static_cast<float>(to_t<T>(x / (1.f + std::exp(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

// RoPE (rotate_half style) in place on the query and key heads of qkv [T, (H + 2 KVH) * D], with
// cos/sin [T, D]; then, if cache is given ([2, blocks, block_size, KVH, D], same dtype), the rotated
// K and V rows of token t are copied to flat slot slots[t] (block * block_size + offset; < 0 skips).
template <typename T>
static void rope_kernel(T* qkv, const T* cos, const T* sin, int64_t tokens, int64_t H, int64_t KVH, int64_t D,
                        T* cache, int64_t v_offset, const int64_t* slots) {
  constexpr int64_t V = Vec::size();
  const int64_t half = D / 2, width = (H + 2 * KVH) * D;
  at::parallel_for(0, tokens, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        T* x = row + h * D;
        int64_t i = 0;
        for (; i + V <= half; i += V) {  // bf16/fp16: x * cos rounded to T, + rotate_half(x) * sin (addcmul)
          const Vec x1 = load_f32<T>(x + i), x2 = load_f32<T>(x + half + i);
          const Vec o1 = at::vec::fmadd(x2.neg(), load_f32<T>(s + i), round_t<T>(x1 * load_f32<T>(c + i)));
          const Vec o2 = at::vec::fmadd(x1, load_f32<T>(s + half + i), round_t<T>(x2 * load_f32<T>(c + half + i)));
          store_t<T>(x + i, o1);
          store_t<T>(x + half + i, o2);
        }
        for (; i < half; ++i) {  // bf16/fp16: x * cos rounded to T, then + rotate_half(x) * sin (addcmul)
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
          const float a1 = static_cast<float>(to_t<T>(x1 * static_cast<float>(c[i])));
          const float a2 = static_cast<float>(to_t<T>(x2 * static_cast<float>(c[half + i])));
          x[i] = to_t<T>(a1 - x2 * static_cast<float>(s[i]));
          x[half + i] = to_t<T>(a2 + x1 * static_cast<float>(s[half + i]));
        }
      }
      if (cache && slots[t] >= 0) {
        T* dst = cache + slots[t] * KVH * D;
        std::memcpy(dst, row + H * D, KVH * D * sizeof(T));
        std::memcpy(dst + v_offset, row + (H + KVH) * D, KVH * D * sizeof(T));
      }
    }
  });
}

template <typename F> static void by_dtype(at::ScalarType t, const char* name, F f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

// Calls f(std::integral_constant<int, C>{}) for heads of D = C vectors (C in 1, 2, 4, 8, 16).
template <typename F> static void by_head_vectors(int64_t D, const char* name, F f) {
  TORCH_CHECK(D % Vec::size() == 0, name, ": head_dim must be a multiple of the vector width");
  switch (D / Vec::size()) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: TORCH_CHECK(false, name, ": unsupported head_dim ", D);
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), "x [T, D], w [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w dtypes differ");
  auto out = torch::empty_like(x);
  by_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T>(x.data_ptr<T>(), nullptr, w.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor res, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && res.is_contiguous() && w.is_contiguous(), "contiguous x, res, w");
  TORCH_CHECK(res.sizes() == x.sizes() && w.numel() == x.size(1), "x, res [T, D], w [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() == res.scalar_type(), "dtypes differ");
  auto out = torch::empty_like(x);
  by_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_kernel<T>(x.data_ptr<T>(), res.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "gate_up [T, 2I], contiguous");
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  by_dtype(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_kernel<T>(gu.data_ptr<T>(), out.data_ptr<T>(), gu.size(0), gu.size(1) / 2);
  });
  return out;
}

void rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t KVH,
                c10::optional<torch::Tensor> cache, c10::optional<torch::Tensor> slots) {
  const int64_t T_ = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0, "qkv [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == T_, "cos, sin [T, D]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "cos/sin dtype");
  TORCH_CHECK(cache.has_value() == slots.has_value(), "cache and slots go together");
  if (cache) {
    TORCH_CHECK(cache->dim() == 5 && cache->size(0) == 2 && cache->size(3) == KVH && cache->size(4) == D && cache->is_contiguous(),
                "cache [2, blocks, block_size, KVH, D], contiguous");
    TORCH_CHECK(cache->scalar_type() == qkv.scalar_type(), "cache dtype");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == T_, "int64 slots [T]");
  }
  by_dtype(qkv.scalar_type(), "rope_write", [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), T_, H, KVH, D,
                   cache ? cache->data_ptr<T>() : nullptr, cache ? cache->stride(0) : 0,
                   slots ? slots->data_ptr<int64_t>() : nullptr);
  });
}

// ---------------------------------------------------------------- projections of a few rows
// y [N, out] = x [N, in] @ W [out, in]^T for small N (decode of a few sequences): the step is then
// bound by reading W, so each weight row is loaded from memory once and multiplied with up to 4 rows
// of x held in L1 (further rows reuse the weight row from L1). Rows of W are split over threads.
// bf16/fp16 values are widened to float32 as they are loaded and FMA'd into float32 accumulators,
// rounded once at the end (as oneDNN's GEMM does). (AVX512-BF16's dot product was no faster: on a
// 2-core AMD EPYC over SmolLM2's projections it read 18 GB/s at 1 row where widening read 28.)
template <typename T, int NT>
static inline void skinny_tile(const T* x, const T* w, T* y, int64_t out, int64_t in) {
  constexpr int64_t V = Vec::size();
  const int64_t vend = in - in % V;
  Vec acc[NT];
  for (int n = 0; n < NT; ++n) acc[n] = Vec(0.f);
  for (int64_t k = 0; k < vend; k += V) {
    const Vec wv = load_f32<T>(w + k);
    for (int n = 0; n < NT; ++n) acc[n] = at::vec::fmadd(load_f32<T>(x + n * in + k), wv, acc[n]);
  }
  for (int n = 0; n < NT; ++n) {
    float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[n]);
    for (int64_t k = vend; k < in; ++k) s += static_cast<float>(x[n * in + k]) * static_cast<float>(w[k]);
    y[n * out] = to_t<T>(s);
  }
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [N, in], w [out, in]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous x and w");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x and w dtypes differ");
  const int64_t N = x.size(0), out = w.size(0), in = w.size(1);
  auto y = torch::empty({N, out}, x.options());
  by_dtype(x.scalar_type(), "skinny_linear", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    // ~64 KB of weights per task: enough to amortise a thread's start, small enough to balance
    const int64_t grain = std::max<int64_t>(1, 65536 / static_cast<int64_t>(sizeof(T)) / std::max<int64_t>(1, in));
    at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        const T* wr = wp + o * in;
        int64_t n = 0;
        for (; n + 4 <= N; n += 4) skinny_tile<T, 4>(xp + n * in, wr, yp + n * out + o, out, in);
        switch (N - n) {
          case 1: skinny_tile<T, 1>(xp + n * in, wr, yp + n * out + o, out, in); break;
          case 2: skinny_tile<T, 2>(xp + n * in, wr, yp + n * out + o, out, in); break;
          case 3: skinny_tile<T, 3>(xp + n * in, wr, yp + n * out + o, out, in); break;
          default: break;
        }
      }
    });
  });
  return y;
}

int64_t vec_size() { return Vec::size(); }

// ---------------------------------------------------------------- prefill attention over the paged cache
// Causal attention for the query tokens of prefill chunks, reading K and V from the paged cache (the
// chunk's own K/V were written there by rope_write before the call). Sequence s has q_len[s] query
// tokens at rows q_start[s].. of q, the last of its ctx[s] cached tokens; query i sees keys
// 0 .. ctx - q_len + i. A flash-attention loop in float32:
// - a first pass widens each (sequence, KV head)'s K and V rows to float32 once (every query tile of
//   the sequence reuses them);
// - work items are (sequence, KV head, query tile): up to kRowVecs vectors of rows, a row being one
//   query token x one of the G query heads that share the KV head (GQA: K/V are read once for all G);
// - queries are held transposed ([D][rows]), so a score tile is register-blocked as JB keys x the
//   rows' vectors (one broadcast K value per FMA row), and the online softmax runs down columns with
//   the rows in vector lanes; P V accumulates in register tiles of kAccRegs / (D / vector width) rows x D.
// Items are handed out largest first from a shared counter, so causal tiles of unequal cost balance.
// bf16 on a CPU with AVX512-BF16 runs both products as bf16 dot products instead (`kDpBf16` below:
// 1.5x the widening loop's speed on SmolLM2's heads, 4 x 256 and 4 x 1024 tokens).
// Register budget for accumulator tiles: 24 of AVX512's 32 vector registers, 12 of AVX2's 16.
constexpr int64_t kRowVecs = 4, kKT = 64;
constexpr int kAccRegs = Vec::size() >= 16 ? 24 : 12;

// s[j][0..NRV vectors) = sum_d k[j][d] * qt[d][..] for j < JB (k rows of D floats, qt [D][ld]).
template <int NRV, int JB>
static inline void score_tile(const float* qt, int64_t ld, const float* const* k, int64_t D, float* s, int64_t lds) {
  constexpr int64_t V = Vec::size();
  Vec acc[JB][NRV];
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec qd[NRV];
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) qd[c] = Vec::loadu(qt + d * ld + c * V);
#pragma GCC unroll 32
    for (int j = 0; j < JB; ++j) {
      const Vec kj(k[j][d]);
#pragma GCC unroll 8
      for (int c = 0; c < NRV; ++c) acc[j][c] = at::vec::fmadd(kj, qd[c], acc[j][c]);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c].store(s + j * lds + c * V);
}

// o[r][0..C vectors) += sum_j p[j][r] * v[j][..] for r < RB (p [keys][ldp], v rows of C vectors).
template <int C, int RB>
static inline void pv_tile(const float* p, int64_t ldp, const float* const* v, int64_t nk, float* o, int64_t ldo) {
  constexpr int64_t V = Vec::size();
  Vec acc[RB][C];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::loadu(o + r * ldo + c * V);
  for (int64_t j = 0; j < nk; ++j) {
    Vec vj[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vj[c] = Vec::loadu(v[j] + c * V);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const Vec pr(p[j * ldp + r]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(pr, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c].store(o + r * ldo + c * V);
}

template <int NRV>
static void score_tiles(const float* qt, int64_t ld, const float* const* k, int64_t nk, int64_t D, float* s) {
  constexpr int JB = kAccRegs / NRV;  // JB keys x NRV row vectors of accumulators
  int64_t j = 0;
  for (; j + JB <= nk; j += JB) score_tile<NRV, JB>(qt, ld, k + j, D, s + j * ld, ld);
  for (; j < nk; ++j) score_tile<NRV, 1>(qt, ld, k + j, D, s + j * ld, ld);
}

template <int C>
static void pv_tiles(const float* p, int64_t ldp, const float* const* v, int64_t nk, int64_t R, float* o) {
  constexpr int64_t D = C * Vec::size();
  constexpr int RB = std::max(1, kAccRegs / C);  // RB rows x C vectors of accumulators
  int64_t r = 0;
  for (; r + RB <= R; r += RB) pv_tile<C, RB>(p + r, ldp, v, nk, o + r * D, D);
  for (; r < R; ++r) pv_tile<C, 1>(p + r, ldp, v, nk, o + r * D, D);
}

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16: the two products as vdpbf16ps (32 bf16 pairs into 16 float32 lanes), half
// the instructions of widening + FMA and no widening pass for K. Pairs run along the dot product:
// head dims (d, d+1) for the scores, keys (j, j+1) for P V. Queries are packed [D / 2][rows] as
// int32 pairs, V as [keys / 2][D] pairs, P as [keys / 2][rows] pairs (rounded to bf16, as SDPA's
// math path rounds the softmax to the input dtype before P V); K is read in place from the cache.
constexpr bool kDpBf16 = true;
using Pair = int32_t;  // two bf16 values, the first in the low half

// s[j][0..NRV vectors) = sum over d of k[j][d] q[..][d] (unscaled), qp [D / 2][ld] pairs.
template <int NRV, int JB>
static inline void score_tile_dp(const Pair* qp, int64_t ld, const at::BFloat16* const* k, int64_t D, float* s, int64_t lds) {
  __m512 acc[JB][NRV];
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qd[NRV];
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) qd[c] = (__m512bh)_mm512_loadu_si512(qp + d2 * ld + c * 16);
#pragma GCC unroll 32
    for (int j = 0; j < JB; ++j) {
      Pair kj;
      std::memcpy(&kj, k[j] + 2 * d2, sizeof(Pair));
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(kj);
#pragma GCC unroll 8
      for (int c = 0; c < NRV; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qd[c], kb);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < NRV; ++c) _mm512_storeu_ps(s + j * lds + c * 16, acc[j][c]);
}

template <int NRV>
static void score_tiles_dp(const Pair* qp, int64_t ld, const at::BFloat16* const* k, int64_t nk, int64_t D, float* s) {
  constexpr int JB = kAccRegs / NRV;
  int64_t j = 0;
  for (; j + JB <= nk; j += JB) score_tile_dp<NRV, JB>(qp, ld, k + j, D, s + j * ld, ld);
  for (; j < nk; ++j) score_tile_dp<NRV, 1>(qp, ld, k + j, D, s + j * ld, ld);
}

// o[r][0..C vectors) += sum over key pairs of p[jp][r] . v[jp][..] for r < RB (pp [pairs][ldp], vp [pairs][D]).
template <int C, int RB>
static inline void pv_tile_dp(const Pair* pp, int64_t ldp, const Pair* vp, int64_t pairs, float* o, int64_t ldo) {
  constexpr int64_t D = C * 16;
  __m512 acc[RB][C];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * ldo + c * 16);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vj[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) vj[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + c * 16);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pp[jp * ldp + r]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vj[c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * ldo + c * 16, acc[r][c]);
}

template <int C>
static void pv_tiles_dp(const Pair* pp, int64_t ldp, const Pair* vp, int64_t pairs, int64_t R, float* o) {
  constexpr int64_t D = C * 16;
  constexpr int RB = std::max(1, kAccRegs / C);
  int64_t r = 0;
  for (; r + RB <= R; r += RB) pv_tile_dp<C, RB>(pp + r, ldp, vp, pairs, o + r * D, D);
  for (; r < R; ++r) pv_tile_dp<C, 1>(pp + r, ldp, vp, pairs, o + r * D, D);
}

// Pairs of bf16 (a in the low half, b in the high) of two float vectors, rounded to nearest even.
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b)), 16);
  return _mm512_or_si512(lo, hi);
}

// ---- the decode kernel's bf16 dot-product path (head_dim a multiple of 32), same work items as
// `decode_kernel`:
// - scores: 16 keys at a time, each K row used as stored (D / 32 vdpbf16ps per query head and key),
//   the 16 keys' partial lanes summed by one transposing tree (`sum16`: 45 instructions for 16
//   scores, where a horizontal sum per score takes ~9);
// - P V: the V rows of two keys interleaved into pairs (unpacklo / unpackhi, so accumulator lanes
//   hold a permutation of the head dims, undone at the end) times the two keys' probabilities,
//   rounded to bf16 as in the prefill path; softmax and accumulation stay float32;
// - memory: these loops read a 16-key group's rows once per (KV head, query head), an order the
//   hardware prefetcher follows poorly (from memory this was slower than the widening kernel, though
//   1.6x faster in cache). So each group is first read in address order, one load per cache line
//   (the loops then hit L1), while the next group is prefetched into L2 (`stage`). Measured over 30
//   layers of a 16 x 2048-token cache: 34 ms against the widening kernel's 52 (22 GB/s, where a
//   loop that only loads the same bytes reaches ~24).

// lane j of the result = the sum of the 16 lanes of v[j], j < 16.
static inline __m512 sum16(const __m512* v) {
  __m512 c[4];
  for (int k = 0; k < 4; ++k) {
    const __m512* w = v + 4 * k;
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  }  // c[k], 128-bit lane L: v[4k .. 4k + 3], each summed over its lane L
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, 0x88), _mm512_shuffle_f32x4(f01, f23, 0xDD));
}

template <int C2>  // C2 = D / 32: bf16 vectors per head row
static void decode_kernel_dp(const at::BFloat16* q, const at::BFloat16* kv, const int64_t* table, const int64_t* ctx,
                             at::BFloat16* out, int64_t B, int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks,
                             int64_t v_offset, float scale) {
  constexpr int64_t D = C2 * 32;
  constexpr int64_t GB = std::max(1, 12 / (2 * C2));  // query heads whose P V accumulators are in registers at once
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t per_item = B >= at::get_num_threads() ? KVH : 1;
  const int64_t row_bytes = per_item * D * static_cast<int64_t>(sizeof(at::BFloat16));
  at::parallel_for(0, B * (KVH / per_item), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv, accs;
    std::vector<Pair> probs;
    std::vector<const at::BFloat16*> krow;  // each key's K row (its V row is v_offset further)
    std::vector<at::BFloat16> zeros(KVH * D);  // the rows past the context (any KV head's offset stays inside)
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (KVH / per_item), h0 = (w % (KVH / per_item)) * per_item, n = ctx[b];
      const int64_t rows = per_item * G, n16 = (n + 15) / 16 * 16, np = (n + 1) / 2;
      const int64_t* blocks = table + b * max_blocks;
      const at::BFloat16* qb = q + (b * H + h0 * G) * D;
      krow.resize(n16);
      for (int64_t t0 = 0, bi = 0; t0 < n; t0 += BS, ++bi) {
        const at::BFloat16* base = kv + blocks[bi] * blk_stride + h0 * D;
        for (int64_t t = 0; t < std::min(BS, n - t0); ++t) krow[t0 + t] = base + t * tok_stride;
      }
      for (int64_t t = n; t < n16; ++t) krow[t] = zeros.data();
      // keys t0 .. t0 + 15 read in address order, one load per line; keys t0 + 16 .. t0 + 31 prefetched into L2
      auto stage = [&](int64_t t0, int64_t off) {
        __m512i sink = _mm512_setzero_si512();
        for (int64_t t = t0; t < std::min(n, t0 + 16); ++t) {
          const char* r = reinterpret_cast<const char*>(krow[t] + off);
          for (int64_t x = 0; x < row_bytes; x += 64) sink = _mm512_or_si512(sink, _mm512_loadu_si512(r + x));
        }
        asm volatile("" : : "v"(sink));
        for (int64_t t = t0 + 16; t < std::min(n, t0 + 32); ++t) {
          const char* r = reinterpret_cast<const char*>(krow[t] + off);
          for (int64_t x = 0; x < row_bytes; x += 64) _mm_prefetch(r + x, _MM_HINT_T1);
        }
      };
      scores.resize(rows * n16);
      inv.resize(rows);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        stage(t0, 0);
        const at::BFloat16* const* k = krow.data() + t0;
        for (int64_t hh = 0; hh < per_item; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const at::BFloat16* qr = qb + (hh * G + g) * D;
            __m512bh qv[C2];
            for (int c = 0; c < C2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
            __m512 acc[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
              const at::BFloat16* kr = k[j] + hh * D;
              acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
#pragma GCC unroll 8
              for (int c = 1; c < C2; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            }
            _mm512_storeu_ps(scores.data() + (hh * G + g) * n16 + t0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
          }
      }
      // softmax per row, then the probabilities as bf16 pairs (key 2i in the low half, 2i + 1 in the high)
      probs.resize(rows * np);
      const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * n16;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, s, s, n);
        inv[r] = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
        if (n % 2) s[n] = 0.f;  // the partner of an odd last key (n16 > n)
        int64_t i = 0;
        for (; i + 16 <= np; i += 16) {
          const __m512i lo = _mm512_loadu_si512(s + 2 * i), hi = _mm512_loadu_si512(s + 2 * i + 16);
          _mm512_storeu_si512(probs.data() + r * np + i,
                              bf16_pairs(_mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, even, hi)),
                                         _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, odd, hi))));
        }
        for (; i < np; ++i) {
          const at::BFloat16 e = static_cast<at::BFloat16>(s[2 * i]), o = static_cast<at::BFloat16>(s[2 * i + 1]);
          probs[r * np + i] = static_cast<Pair>(static_cast<uint32_t>(e.x) | (static_cast<uint32_t>(o.x) << 16));
        }
      }
      // P V, 8 key pairs (one staged group) at a time; per KV head, GB query heads' accumulators in
      // registers, kept in `accs` between groups: [row][c][unpacklo / unpackhi][16]
      accs.assign(rows * C2 * 2 * 16, 0.f);
      for (int64_t p0 = 0; p0 < np; p0 += 8) {
        stage(2 * p0, v_offset);
        const int64_t p1 = std::min(np, p0 + 8);
        for (int64_t hh = 0; hh < per_item; ++hh)
          for (int64_t g0 = 0; g0 < G; g0 += GB) {
            const int64_t gn = std::min(GB, G - g0);
            float* ab = accs.data() + (hh * G + g0) * C2 * 32;
            __m512 acc[GB][C2][2];
            for (int64_t g = 0; g < gn; ++g)
              for (int c = 0; c < C2; ++c)
                for (int h = 0; h < 2; ++h) acc[g][c][h] = _mm512_loadu_ps(ab + ((g * C2 + c) * 2 + h) * 16);
            for (int64_t tp = p0; tp < p1; ++tp) {
              const at::BFloat16* va = krow[2 * tp] + v_offset + hh * D;
              const at::BFloat16* vb = 2 * tp + 1 < n ? krow[2 * tp + 1] + v_offset + hh * D : zeros.data();
              __m512bh lo[C2], hi[C2];
              for (int c = 0; c < C2; ++c) {
                const __m512i x = _mm512_loadu_si512(va + 32 * c), y = _mm512_loadu_si512(vb + 32 * c);
                lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
              }
              for (int64_t g = 0; g < gn; ++g) {
                const __m512bh pr = (__m512bh)_mm512_set1_epi32(probs[(hh * G + g0 + g) * np + tp]);
                for (int c = 0; c < C2; ++c) {
                  acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], pr, lo[c]);
                  acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], pr, hi[c]);
                }
              }
            }
            for (int64_t g = 0; g < gn; ++g)
              for (int c = 0; c < C2; ++c)
                for (int h = 0; h < 2; ++h) _mm512_storeu_ps(ab + ((g * C2 + c) * 2 + h) * 16, acc[g][c][h]);
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* o = out + (b * H + h0 * G + r) * D;
        for (int c = 0; c < C2; ++c) {
          const float* lo = accs.data() + (r * C2 + c) * 32;
          const float* hi = lo + 16;
          // lane 4L + i of unpacklo is head dim 32c + 8L + i, of unpackhi 32c + 8L + 4 + i (L: 128-bit lane)
          for (int L = 0; L < 4; ++L)
            for (int i = 0; i < 4; ++i) {
              o[32 * c + 8 * L + i] = static_cast<at::BFloat16>(lo[4 * L + i] * inv[r]);
              o[32 * c + 8 * L + 4 + i] = static_cast<at::BFloat16>(hi[4 * L + i] * inv[r]);
            }
        }
      }
    }
  });
}
#else
constexpr bool kDpBf16 = false;
#endif

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor table, torch::Tensor ctx, double scale) {
  NoGil no_gil;
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [B, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && table.is_contiguous() && ctx.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "int64 block table and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == B && ctx.size(0) == B, "shape mismatch");
  auto out = torch::empty_like(q);
  by_dtype(q.scalar_type(), "paged_decode", [&](auto tag) {
    using T = decltype(tag);
    by_head_vectors(D, "paged_decode", [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16> && Vec::size() == 16 && C % 2 == 0) {  // head_dim % 32 == 0
        decode_kernel_dp<C / 2>(q.data_ptr<T>(), kv.data_ptr<T>(), table.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(),
            out.data_ptr<T>(), B, H, KVH, BS, table.size(1), kv.stride(0), static_cast<float>(scale));
        return;
      }
#endif
      decode_kernel<T, C>(q.data_ptr<T>(), kv.data_ptr<T>(), table.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, KVH, BS, table.size(1), kv.stride(0), static_cast<float>(scale));
    });
  });
  return out;
}


template <typename T, int C>
static void prefill_kernel(const T* q, int64_t q_row_stride, const T* kv, int64_t v_offset, const int64_t* table,
                           int64_t max_blocks, const int64_t* q_start, const int64_t* q_len, const int64_t* ctx, T* out,
                           int64_t S, int64_t H, int64_t KVH, int64_t BS, float scale) {
  constexpr int64_t V = Vec::size(), D = C * V;
  constexpr bool DP = kDpBf16 && std::is_same_v<T, at::BFloat16> && V == 16;  // the vdpbf16ps path
  const int64_t G = H / KVH, tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const int64_t QT = std::max<int64_t>(1, kRowVecs * V / G);  // query tokens per tile
  auto row = [&](int64_t s, int64_t h, int64_t t) {  // token t's K row of sequence s, KV head h, in the cache
    return kv + table[s * max_blocks + t / BS] * blk_stride + (t % BS) * tok_stride + h * D;
  };
  // First pass, per (sequence, KV head), 32-bit words at base[s * KVH + h]: float32 K then V rows
  // ([2][keys][D]), or for DP V's key pairs ([keys / 2][D] bf16 pairs; K is read in place).
  std::vector<int64_t> base(S * KVH + 1, 0);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      base[s * KVH + h + 1] = base[s * KVH + h] + (DP ? (ctx[s] + 1) / 2 * D : 2 * ctx[s] * D);
  std::unique_ptr<float[]> kvf(new float[base.back()]);  // every word is written below
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / KVH, h = w % KVH, n = ctx[s];
      float* kf = kvf.get() + base[w];
      if constexpr (DP) {
#if defined(__AVX512BF16__)
        Pair* vp = reinterpret_cast<Pair*>(kf);
        for (int64_t t = 0; t < n; t += 2) {
          const T* v0 = row(s, h, t) + v_offset;
          for (int c = 0; c < C; ++c) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c * V)));
            const __m512i hi = t + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(s, h, t + 1) + v_offset + c * V)))
                                         : _mm512_setzero_si512();  // an odd count's last pair: the missing key is 0
            _mm512_storeu_si512(vp + (t / 2) * D + c * V, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
          }
        }
#endif
      } else {
        float* vf = kf + n * D;
        for (int64_t t = 0; t < n; ++t) {
          const T* kr = row(s, h, t);
          for (int c = 0; c < C; ++c) {
            load_f32<T>(kr + c * V).store(kf + t * D + c * V);
            load_f32<T>(kr + v_offset + c * V).store(vf + t * D + c * V);
          }
        }
      }
    }
  });
  struct Item { int64_t s, h, i0, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i0 = 0; i0 < q_len[s]; i0 += QT) {
      const int64_t keys = ctx[s] - q_len[s] + std::min(q_len[s], i0 + QT);
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, i0, keys * std::min(QT, q_len[s] - i0)});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n_items = items.size(), LD = kRowVecs * V;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    // qt: queries [D][LD] floats, or for DP [D / 2][LD] pairs; sc: scores [kKT][LD]; pp (DP): P's key pairs
    std::vector<float> qt(D * LD), sc(kKT * LD), o(LD * D), m(LD), l(LD), lim(LD), pp(DP ? kKT / 2 * LD : 0);
    std::vector<const float*> kp(DP ? 0 : kKT), vp(DP ? 0 : kKT);  // K/V rows of a key tile: float32 copies,
    std::vector<const T*> kr(DP ? kKT : 0);                         // or (DP) K rows in the cache
    for (int64_t w = next++; w < n_items; w = next++) {
      const Item it = items[w];
      const int64_t nq = std::min(QT, q_len[it.s] - it.i0), R = nq * G, NRV = (R + V - 1) / V, past = ctx[it.s] - q_len[it.s];
      const float* kf = kvf.get() + base[it.s * KVH + it.h];  // the first pass's words (DP: V's key pairs)
      // queries transposed: qt[d][r], r = i * G + g (query token it.i0 + i, head it.h * G + g),
      // pre-scaled floats; for DP unscaled bf16 pairs qt[d / 2][r] (the scale multiplies the scores)
      if (R % V)  // rows padding the last vector: zero queries (their outputs are not stored)
        for (int64_t d = 0; d < D; ++d) std::fill(qt.data() + d * LD + R, qt.data() + d * LD + NRV * V, 0.f);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + (q_start[it.s] + it.i0 + i) * q_row_stride + (it.h * G + g) * D;
          if constexpr (DP) {
            int32_t* qp = reinterpret_cast<int32_t*>(qt.data());
            for (int64_t d = 0; d < D; d += 2) std::memcpy(qp + (d / 2) * LD + i * G + g, src + d, sizeof(int32_t));
          } else {
            for (int64_t d = 0; d < D; ++d) qt[d * LD + i * G + g] = static_cast<float>(src[d]) * scale;
          }
        }
      for (int64_t r = 0; r < LD; ++r) lim[r] = static_cast<float>(past + it.i0 + std::min(r / G, nq - 1));
      std::fill(o.begin(), o.begin() + R * D, 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t n_keys = past + it.i0 + nq;  // keys seen by the tile's last query token
      for (int64_t j0 = 0; j0 < n_keys; j0 += kKT) {
        const int64_t nk = std::min(kKT, n_keys - j0);
        if constexpr (DP) {
#if defined(__AVX512BF16__)
          for (int64_t j = 0; j < nk; ++j) kr[j] = row(it.s, it.h, j0 + j);
          const Pair* qp = reinterpret_cast<const Pair*>(qt.data());
          switch (NRV) {
            case 1: score_tiles_dp<1>(qp, LD, kr.data(), nk, D, sc.data()); break;
            case 2: score_tiles_dp<2>(qp, LD, kr.data(), nk, D, sc.data()); break;
            case 3: score_tiles_dp<3>(qp, LD, kr.data(), nk, D, sc.data()); break;
            default: score_tiles_dp<4>(qp, LD, kr.data(), nk, D, sc.data()); break;
          }
#endif
        } else {
          const float* vf = kf + ctx[it.s] * D;
          for (int64_t j = 0; j < nk; ++j) { kp[j] = kf + (j0 + j) * D; vp[j] = vf + (j0 + j) * D; }
          switch (NRV) {
            case 1: score_tiles<1>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            case 2: score_tiles<2>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            case 3: score_tiles<3>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
            default: score_tiles<4>(qt.data(), LD, kp.data(), nk, D, sc.data()); break;
          }
        }
        // causal mask where a tile reaches past the first row's position; online softmax per row
        const bool masked = j0 + nk - 1 > past + it.i0;
        for (int64_t c = 0; c < NRV; ++c) {
          const Vec lim_c = Vec::loadu(lim.data() + c * V);
          Vec mx = Vec::loadu(m.data() + c * V);
          for (int64_t j = 0; j < nk; ++j) {
            Vec sj = Vec::loadu(sc.data() + j * LD + c * V);
            if (DP) sj = sj * Vec(scale);
            if (masked) sj = Vec::blendv(Vec(-std::numeric_limits<float>::infinity()), sj, Vec(static_cast<float>(j0 + j)) <= lim_c);
            if (DP || masked) sj.store(sc.data() + j * LD + c * V);
            mx = at::vec::maximum(mx, sj);
          }
          const Vec corr = (Vec::loadu(m.data() + c * V) - mx).exp();
          Vec sum(0.f);
          for (int64_t j = 0; j < nk; ++j) {
            const Vec p = (Vec::loadu(sc.data() + j * LD + c * V) - mx).exp();
            p.store(sc.data() + j * LD + c * V);
            sum = sum + p;
          }
          (Vec::loadu(l.data() + c * V) * corr + sum).store(l.data() + c * V);
          mx.store(m.data() + c * V);
          if (j0 > 0) {
            float cf[V];
            corr.store(cf);
            for (int64_t rr = 0; rr < V && c * V + rr < R; ++rr) {
              float* orow = o.data() + (c * V + rr) * D;
              for (int cc = 0; cc < C; ++cc) (Vec::loadu(orow + cc * V) * Vec(cf[rr])).store(orow + cc * V);
            }
          }
        }
        if constexpr (DP) {
#if defined(__AVX512BF16__)
          Pair* ppp = reinterpret_cast<Pair*>(pp.data());
          const int64_t pairs = (nk + 1) / 2;
          for (int64_t jp = 0; jp < pairs; ++jp)
            for (int64_t c = 0; c < NRV; ++c) {
              const __m512 p0 = _mm512_loadu_ps(sc.data() + 2 * jp * LD + c * V);
              const __m512 p1 = 2 * jp + 1 < nk ? _mm512_loadu_ps(sc.data() + (2 * jp + 1) * LD + c * V) : _mm512_setzero_ps();
              _mm512_storeu_si512(ppp + jp * LD + c * V, bf16_pairs(p0, p1));
            }
          pv_tiles_dp<C>(ppp, LD, reinterpret_cast<const Pair*>(kf) + (j0 / 2) * D, pairs, R, o.data());
#endif
        } else {
          pv_tiles<C>(sc.data(), LD, vp.data(), nk, R, o.data());
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          T* dst = out + ((q_start[it.s] + it.i0 + i) * H + it.h * G + g) * D;
          const Vec inv(1.f / l[r]);
          for (int c = 0; c < C; ++c) store_t<T>(dst + c * V, Vec::loadu(o.data() + r * D + c * V) * inv);
        }
    }
  });
}

// A query tile holds at least one token's G heads: up to kRowVecs vectors of rows.
int64_t prefill_max_group() { return kRowVecs * Vec::size(); }

// q [T, H, D] (rows may be strided, e.g. a view of the qkv projection), kv [2, blocks, BS, KVH, D];
// per sequence: q_start, q_len, ctx (int64 [S]) and its block table row -> out [T, H, D] (rows of
// tokens outside the sequences are left unset).
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor kv, torch::Tensor table, torch::Tensor q_start, torch::Tensor q_len,
                            torch::Tensor ctx, double scale) {
  NoGil no_gil;
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [T, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads contiguous within a row");
  TORCH_CHECK(kv.is_contiguous() && table.is_contiguous() && q_start.is_contiguous() && q_len.is_contiguous() && ctx.is_contiguous(),
              "contiguous kv and tables");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && q_start.scalar_type() == at::kLong && q_len.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong, "int64 tables");
  const int64_t S = q_start.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == S && q_len.size(0) == S && ctx.size(0) == S, "shape mismatch");
  TORCH_CHECK(H / KVH <= prefill_max_group(), "paged_prefill: more than ", prefill_max_group(), " query heads per KV head");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql[s] >= 1 && qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) && cl[s] >= ql[s], "paged_prefill: sequence ", s,
                " has rows ", qs[s], "+", ql[s], " of ", q.size(0), " and context ", cl[s]);
    TORCH_CHECK((cl[s] + BS - 1) / BS <= table.size(1), "paged_prefill: sequence ", s, " has too few blocks");
    for (int64_t b = 0; b < (cl[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tb[s * table.size(1) + b] >= 0 && tb[s * table.size(1) + b] < kv.size(1), "paged_prefill: block id out of range");
  }
  auto out = torch::empty({q.size(0), H, D}, q.options());
  by_dtype(q.scalar_type(), "paged_prefill", [&](auto tag) {
    using T = decltype(tag);
    by_head_vectors(D, "paged_prefill", [&](auto chunks) {
      prefill_kernel<T, decltype(chunks)::value>(q.data_ptr<T>(), q.stride(0), kv.data_ptr<T>(), kv.stride(0),
          table.data_ptr<int64_t>(), table.size(1), q_start.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(),
          ctx.data_ptr<int64_t>(), out.data_ptr<T>(), S, H, KVH, BS, static_cast<float>(scale));
    });
  });
  return out;
}

// ---------------------------------------------------------------- a decode step's layers in one call
// The layer loop of LlamaModel.run_layers for a batch of decode rows only, in C++: the same kernels
// and projections in the same order (the results are bitwise the model's), without a Python call per
// op. Run from Python, the ~25 calls per layer left the OpenMP worker waiting for a third of a
// decode step (docs/model.md). Projections take the path the model chose for this row count:
// 0 skinny_linear on the plain weight, 1 oneDNN's prepacked linear, 2 the same on rows padded to 4,
// 3 at::linear on the plain weight.
static torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed, int64_t path) {
  if (path == 0) return skinny_linear(x, w);
  if (path == 3) return at::linear(x, w);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t n = x.size(0);
  const bool pad = path == 2 && n < 4;
  torch::jit::Stack st{pad ? at::constant_pad_nd(x, {0, 0, 0, 4 - n}) : x, packed, c10::IValue(), c10::IValue(std::string("none")),
                       c10::IValue(c10::List<std::optional<c10::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&st);
  torch::Tensor y = st[0].toTensor();
  return pad ? y.narrow(0, 0, n) : y;
}

// x [T, hidden] (the residual stream), per layer: norms, the four projections' plain weights and
// prepacked ones (w / packed: qkv, o, gate_up, down of layer 0, then layer 1, ...), its KV view;
// -> (residual stream, the last MLP output still to be added to it).
std::vector<torch::Tensor> decode_layers(torch::Tensor x, std::vector<torch::Tensor> in_norm, std::vector<torch::Tensor> post_norm,
    std::vector<torch::Tensor> w, std::vector<torch::Tensor> packed, int64_t path, std::vector<torch::Tensor> kv,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor slots, torch::Tensor table, torch::Tensor ctx,
    double eps, double scale, int64_t H, int64_t KVH) {
  NoGil no_gil;
  const int64_t L = in_norm.size(), T = x.size(0), D = cos.size(1);
  TORCH_CHECK(post_norm.size() == L && kv.size() == L && w.size() == 4 * L && packed.size() == 4 * L, "decode_layers: per-layer lists");
  torch::Tensor delta;
  for (int64_t l = 0; l < L; ++l) {
    torch::Tensor h;
    if (delta.defined()) {
      h = add_rms_norm(delta, x, in_norm[l], eps);  // delta += x: the sum is the residual stream
      x = delta;
    } else {
      h = rms_norm(x, in_norm[l], eps);
    }
    torch::Tensor qkv = project(h, w[4 * l], packed[4 * l], path);
    rope_write(qkv, cos, sin, H, KVH, kv[l], slots);
    torch::Tensor attn = paged_decode(qkv.narrow(1, 0, H * D).view({T, H, D}).contiguous(), kv[l], table, ctx, scale);
    torch::Tensor o = project(attn.view({T, H * D}), w[4 * l + 1], packed[4 * l + 1], path);
    h = add_rms_norm(o, x, post_norm[l], eps);
    x = o;
    delta = project(silu_mul(project(h, w[4 * l + 2], packed[4 * l + 2], path)), w[4 * l + 3], packed[4 * l + 3], path);
  }
  return {x, delta};
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
            functions=["paged_decode", "paged_prefill", "prefill_max_group", "vec_size", "rms_norm", "add_rms_norm", "silu_mul", "rope_write", "skinny_linear", "decode_layers"],
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


GRAIN = 32768  # elements; the C++ kGrain (a call splits rows over threads only above it)
DECODE_PATHS = ("kernel", "prepacked", "padded", "plain")  # `decode_layers`' projection paths, by number


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


def paged_attention_supported(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `paged_decode_attention` and `paged_prefill_attention` handle this attention: heads of
    `head_dim` a multiple of the vector width (1-16 vectors), and (prefill) at most 32-64 query heads per
    KV head (four vectors of rows, by the CPU's vector width). Call `available()` first."""
    assert _op is not None, "paged_attention_supported called before available()"
    chunks = head_dim // _op.vec_size()
    return (head_dim % _op.vec_size() == 0 and chunks in (1, 2, 4, 8, 16)
            and num_heads // num_kv_heads <= _op.prefill_max_group())


def paged_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), kv_layer [2, num_blocks, block_size, kv_heads, D] (one layer
    of `KVCache`), block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D].
    Query head j attends with KV head j // (H // kv_heads). Call `available()` first."""
    assert _op is not None, "paged_decode_attention called before available()"
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's layers in one call (see `LlamaModel.run_layers`): hidden [T, D], one query token
    per sequence -> (residual stream, last MLP output). Per layer its norms, KV view and the four
    projections (qkv, o, gate_up, down; plain and prepacked weights, `path` the index in
    `DECODE_PATHS` of the `Linear` path to take). Call `available()` first."""
    x, delta = _op.decode_layers(hidden, input_norms, post_norms, weights, packed, path, kv_layers, cos, sin, slots,
                                 block_table, context_lens, eps, scale, num_heads, num_kv_heads)
    return x, delta

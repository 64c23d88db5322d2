// What every kernel file shares: float32 vectors loaded from and stored to float32, bf16 or fp16
// (rounded where the PyTorch formula a kernel replaces stores a tensor), dispatch on the dtype and
// on the head size, bf16 pairs for AVX512-BF16's dot product, and the GIL guard of the long calls.
#pragma once

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "ops.h"

using Vec = at::vec::Vectorized<float>;

// The long entry points (decode_layers, a whole decode step; the two attention kernels) release the
// GIL while they compute, as PyTorch's own ops do: holding it froze the serving event loop for the
// whole step (timers woke late; new requests and streamed tokens waited for the step's end). The
// short elementwise ones keep it: each release is a chance for a busy event loop to take the GIL
// for up to a switch interval. Calls from inside another kernel (decode_layers -> paged_decode)
// hold no GIL and release nothing.
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

// dst[w * ld + j] = rows[j][w] for j < Vec::size() (keys), w < W (32-bit words: floats or bf16 pairs).
inline void transpose_rows(const uint32_t* const* rows, int64_t W, uint32_t* dst, int64_t ld) {
#if defined(CPU_CAPABILITY_AVX512)
  if (W % 16 == 0) {
    for (int64_t w0 = 0; w0 < W; w0 += 16) {
      __m512 in[16], t[16];
      for (int j = 0; j < 16; ++j) in[j] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[j] + w0));
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {
        in[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        in[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        in[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
        in[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
      }
      for (int i = 0; i < 2; ++i)
        for (int k = 0; k < 4; ++k) {
          t[8 * i + k] = _mm512_shuffle_f32x4(in[8 * i + k], in[8 * i + k + 4], 0x88);
          t[8 * i + k + 4] = _mm512_shuffle_f32x4(in[8 * i + k], in[8 * i + k + 4], 0xdd);
        }
      for (int i = 0; i < 16; ++i) {
        const __m512 r = i < 8 ? _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88) : _mm512_shuffle_f32x4(t[i - 8], t[i], 0xdd);
        _mm512_storeu_si512(dst + (w0 + i) * ld, _mm512_castps_si512(r));
      }
    }
    return;
  }
#endif
  for (int64_t w = 0; w < W; ++w)
    for (int64_t j = 0; j < Vec::size(); ++j) dst[w * ld + j] = rows[j][w];
}

// Whether this process may use AMX tiles (asked of the kernel once; invariant_linear.cpp): false
// where the build or the CPU has no AMX.
bool amx_usable();

template <typename T> inline T to_t(float x) { return static_cast<T>(x); }

// Calls f(T{}) for the tensor dtype t (float32, bf16, fp16).
template <typename F> inline void by_dtype(at::ScalarType t, const char* name, F f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

// Calls f(std::integral_constant<int, C>{}) for heads of D = C vectors (C in 1, 2, 4, 8, 16).
template <typename F> inline void by_head_vectors(int64_t D, const char* name, F f) {
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

#if defined(__AVX512BF16__)
// The attention kernels' bf16 dot-product paths (vdpbf16ps) take their operands as pairs.
using Pair = int32_t;  // two bf16 values, the first in the low half

// Pairs of bf16 (a in the low half, b in the high) of two float vectors, rounded to nearest even.
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b)), 16);
  return _mm512_or_si512(lo, hi);
}
#endif

// The arguments of the two prompt-chunk attention kernels (paged_prefill, paged_prefill_amx): q [T, H, D]
// with each row's heads contiguous, kv [2, blocks, block_size, KVH, D] and int64 tables, every sequence's
// rows inside q and its context's blocks inside kv. `name` prefixes the messages.
inline void check_prompt_chunks(const char* name, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                                const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& ctx) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "q [T, H, D], kv [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads contiguous within a row");
  TORCH_CHECK(kv.is_contiguous() && table.is_contiguous() && q_start.is_contiguous() && q_len.is_contiguous() && ctx.is_contiguous(),
              "contiguous kv and tables");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && q_start.scalar_type() == at::kLong && q_len.scalar_type() == at::kLong &&
              ctx.scalar_type() == at::kLong, "int64 tables");
  const int64_t S = q_start.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(3), BS = kv.size(2);
  TORCH_CHECK(kv.size(4) == D && H % KVH == 0 && table.size(0) == S && q_len.size(0) == S && ctx.size(0) == S, "shape mismatch");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql[s] >= 1 && qs[s] >= 0 && qs[s] + ql[s] <= q.size(0) && cl[s] >= ql[s], name, ": sequence ", s,
                " has rows ", qs[s], "+", ql[s], " of ", q.size(0), " and context ", cl[s]);
    TORCH_CHECK((cl[s] + BS - 1) / BS <= table.size(1), name, ": sequence ", s, " has too few blocks");
    for (int64_t b = 0; b < (cl[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tb[s * table.size(1) + b] >= 0 && tb[s * table.size(1) + b] < kv.size(1), name, ": block id out of range");
  }
}
